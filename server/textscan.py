"""Helpers for parsers that read a growing model output: how much of a text's tail might still become a marker."""
from __future__ import annotations


def partial_suffix_len(text: str, markers: tuple[str, ...] | list[str], start: int = 0) -> int:
    """Length of the longest tail of ``text[start:]`` that is a proper prefix of one of ``markers``: text a
    streaming parser must hold back, because the next characters may complete the marker (``"</thi"``)."""
    best = 0
    n = len(text) - start
    for marker in markers:
        for k in range(min(len(marker) - 1, n), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best
