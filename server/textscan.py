"""Helpers for parsers that read a growing model output: how much of a text's tail might still become a marker, and
finding a marker by searching only what is new."""
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


class Finder:
    """The first occurrence of ``needle`` at or after ``start`` in a text that only grows between calls: each call
    searches only the part not searched before, so a stream costs O(new text) per step. ``find(text)`` equals
    ``text.find(needle, start)``."""

    def __init__(self, needle: str, start: int = 0):
        self.needle, self.start = needle, start
        self.searched = start  # text[start:searched] holds no whole needle
        self.found = -1

    def find(self, text: str) -> int:
        if self.found < 0 and len(text) > self.searched - len(self.needle) + 1:
            i = text.find(self.needle, max(self.start, self.searched - len(self.needle) + 1))
            self.searched = max(self.searched, len(text))
            if i >= 0:
                self.found = i
        return self.found
