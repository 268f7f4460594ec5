"""The reasoning-parser contract: split a model's output into its chain of thought (``reasoning``) and its answer
(``content``), at once (`extract`) or while it streams (`delta`).

A parser is pure: what it returns depends only on the texts it is given. `layout(text, final)` marks which
characters of ``text`` are reasoning and which are content (marker characters are neither); with ``final`` False
it leaves out a tail that might still become a marker (``"</thi"``), so what a stream has emitted never has to be
taken back. `delta` is the difference of the layouts of the previous and the current text, so the deltas of any
chunking of a text add up to `extract` of that text.

Two modes, both delimited by ``<think>`` … ``</think>``:

* open: the block is open from the first generated character (the chat template opened it in the prompt): text
  before the first ``</think>`` is reasoning (a ``<think>`` generated before it is dropped), text after it is
  content; an output without ``</think>`` (cut off while thinking) is all reasoning.
* explicit: only text inside a generated ``<think>`` … ``</think>`` pair is reasoning; everything else is content
  (a block still open at the end counts as reasoning).

A subclass chooses the mode per request (`explicit`). In both, a prompt whose last think marker is ``</think>``
has closed the block already (a template that disables thinking writes an empty block), so the output is read in
explicit mode, as vLLM's serving layer does.
"""
from __future__ import annotations

from typing import Any, ClassVar

from server.textscan import Finder, partial_suffix_len

REASONING, CONTENT = "reasoning", "content"

#: (kind, start, stop) slices of a text, in order
Layout = list[tuple[str, int, int]]


class ReasoningParser:
    name: ClassVar[str] = ""
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"

    def __init__(self, prompt_text: str = "", chat_template_kwargs: dict[str, Any] | None = None):
        self.explicit_mode = (self.prompt_ends_reasoning(prompt_text)
                              or self.explicit(dict(chat_template_kwargs or {})))
        self._memo: tuple[int, dict[str, int], _Finders] | None = None  # the last `delta`'s text length, sizes

    # -- the per-request choice -------------------------------------------------------------------------
    def explicit(self, chat_template_kwargs: dict[str, Any]) -> bool:
        """Whether only an explicit ``<think>`` block is reasoning (default: the block opens in the prompt)."""
        return False

    def prompt_ends_reasoning(self, prompt_text: str) -> bool:
        return prompt_text.rfind(self.end) > prompt_text.rfind(self.start)

    # -- the split ----------------------------------------------------------------------------------------
    def layout(self, text: str, final: bool, finders: "_Finders | None" = None) -> Layout:
        """The split of ``text``. ``finders`` carry the marker searches of a text that only grows (`delta`);
        without them the layout is computed from scratch."""
        f = finders if finders is not None else _Finders(self)
        return self._explicit_layout(text, final, f) if self.explicit_mode else self._open_layout(text, final, f)

    def _open_layout(self, text: str, final: bool, f: "_Finders") -> Layout:
        e = f.end.find(text)
        s = f.start.find(text)
        if e >= 0:
            stop = e
        else:
            markers = (self.end,) if s >= 0 else (self.end, self.start)
            stop = len(text) - (0 if final else partial_suffix_len(text, markers))
        if 0 <= s and s + len(self.start) <= stop:
            out = [(REASONING, 0, s), (REASONING, s + len(self.start), stop)]
        else:
            out = [(REASONING, 0, stop)]
        if e >= 0:
            out.append((CONTENT, e + len(self.end), len(text)))
        return out

    def _explicit_layout(self, text: str, final: bool, f: "_Finders") -> Layout:
        s = f.start.find(text)
        if s < 0:
            return [(CONTENT, 0, len(text) - (0 if final else partial_suffix_len(text, (self.start,))))]
        body = s + len(self.start)
        e = f.end_after(body).find(text)
        if e < 0:
            stop = len(text) - (0 if final else partial_suffix_len(text, (self.end,), body))
            return [(CONTENT, 0, s), (REASONING, body, stop)]
        return [(CONTENT, 0, s), (REASONING, body, e), (CONTENT, e + len(self.end), len(text))]

    # -- the two uses -------------------------------------------------------------------------------------
    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a complete output; an empty part is None."""
        parts = _gather(text, self.layout(text, final=True))
        return parts[REASONING] or None, parts[CONTENT] or None

    def delta(self, previous_text: str, current_text: str, delta_text: str,
              final: bool = False) -> tuple[str, str]:
        """(reasoning, content) newly decided when the output grew from ``previous_text`` to ``current_text``
        (= ``previous_text + delta_text``); ``final``: the output is complete, release any held-back tail.
        Consecutive calls of one stream reuse the previous call's work (O(new text) per call)."""
        assert current_text.endswith(delta_text) and len(current_text) == len(previous_text) + len(delta_text)
        memo = self._memo
        if memo is None or memo[0] != len(previous_text):
            finders = _Finders(self)
            memo = (len(previous_text), _sizes(self.layout(previous_text, False, finders)), finders)
        _, sent, finders = memo
        now = self.layout(current_text, final, finders)
        self._memo = (len(current_text), _sizes(now), finders)
        return _tail(current_text, now, REASONING, sent[REASONING]), _tail(current_text, now, CONTENT, sent[CONTENT])


class _Finders:
    """The marker searches of one growing text."""

    def __init__(self, parser: ReasoningParser):
        self.start, self.end = Finder(parser.start), Finder(parser.end)
        self._end_marker = parser.end
        self._after: Finder | None = None

    def end_after(self, body: int) -> Finder:
        if self._after is None or self._after.start != body:
            self._after = Finder(self._end_marker, body)
        return self._after


def _sizes(layout: Layout) -> dict[str, int]:
    out = {REASONING: 0, CONTENT: 0}
    for kind, a, b in layout:
        out[kind] += b - a
    return out


def _gather(text: str, layout: Layout) -> dict[str, str]:
    out = {REASONING: "", CONTENT: ""}
    for kind, a, b in layout:
        out[kind] += text[a:b]
    return out


def _tail(text: str, layout: Layout, kind: str, skip: int) -> str:
    """The characters of ``kind`` in ``layout`` after the first ``skip`` of them (sliced, not rebuilt)."""
    parts = []
    for k, a, b in layout:
        if k != kind or b <= a:
            continue
        n = b - a
        if skip >= n:
            skip -= n
            continue
        parts.append(text[a + skip:b])
        skip = 0
    return "".join(parts)
