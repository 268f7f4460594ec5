"""Reasoning parsers (server/reasoning/): hand-worked splits for both parsers and modes, and for any chunking of
any output (hypothesis) the stream's deltas add up to the non-streamed split, never emit a partial marker and
never take back what they emitted."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server import reasoning
from server.reasoning.base import ReasoningParser
from server.textscan import partial_suffix_len

R1, QWEN3 = reasoning.get("deepseek_r1"), reasoning.get("qwen3")
NO_THINKING = {"enable_thinking": False}


def test_registry():
    assert reasoning.names() == ["deepseek_r1", "qwen3"]
    with pytest.raises(ValueError, match="unknown reasoning parser 'granite'.*deepseek_r1, qwen3"):
        reasoning.get("granite")


# (text, (reasoning, content) in open mode, (reasoning, content) in explicit mode), worked by hand
CASES = [
    ("<think>abc</think>def", ("abc", "def"), ("abc", "def")),
    ("abc</think>def", ("abc", "def"), (None, "abc</think>def")),
    ("abc</think>", ("abc", None), (None, "abc</think>")),
    ("</think>def", (None, "def"), (None, "</think>def")),
    ("abc", ("abc", None), (None, "abc")),  # open: cut off while thinking
    ("<think>abc", ("abc", None), ("abc", None)),
    ("", (None, None), (None, None)),
    ("x<think>abc</think>def", ("xabc", "def"), ("abc", "xdef")),
    ("<think>a<think>b</think>c</think>d", ("a<think>b", "c</think>d"), ("a<think>b", "c</think>d")),
    ("ab</think>c<think>d</think>e", ("ab", "c<think>d</think>e"), ("d", "ab</think>ce")),
    ("</thi", ("</thi", None), (None, "</thi")),  # complete output: a partial marker is just text
]


@pytest.mark.parametrize("text,open_split,explicit_split", CASES)
def test_extract_hand_worked(text, open_split, explicit_split):
    assert R1().extract(text) == open_split
    assert QWEN3().extract(text) == open_split  # thinking on (the default): the block may open in the prompt
    assert QWEN3(chat_template_kwargs=NO_THINKING).extract(text) == explicit_split
    assert R1(prompt_text="<think>\n\n</think>\n\n").extract(text) == explicit_split


def test_mode_choice():
    assert not R1().explicit_mode and not QWEN3().explicit_mode
    assert QWEN3(chat_template_kwargs={"enable_thinking": False}).explicit_mode
    assert not QWEN3(chat_template_kwargs={"enable_thinking": True}).explicit_mode
    assert not R1(chat_template_kwargs={"enable_thinking": False}).explicit_mode  # deepseek_r1 ignores the switch
    # the prompt's last think marker decides whether the block is already closed
    assert R1(prompt_text="<|User|>hi<|Assistant|><think>\n").explicit_mode is False
    assert QWEN3(prompt_text="user: q</think>a<think>\n").explicit_mode is False
    assert QWEN3(prompt_text="<think>\n\n</think>\n\n").explicit_mode is True


def _stream(parser: ReasoningParser, chunks: list[str]) -> list[tuple[str, str]]:
    out, text = [], ""
    for i, chunk in enumerate(chunks):
        out.append(parser.delta(text, text + chunk, chunk, final=i == len(chunks) - 1))
        text += chunk
    return out


def test_stream_holds_a_partial_marker_back():
    deltas = _stream(R1(), ["abc</th", "ink>de", "f"])
    assert deltas == [("abc", ""), ("", "de"), ("", "f")]
    deltas = _stream(R1(), ["<th", "in", "k>ab", "c</", "x"])  # "</" that turns out not to be the marker
    assert deltas == [("", ""), ("", ""), ("ab", ""), ("c", ""), ("</x", "")]
    deltas = _stream(QWEN3(chat_template_kwargs=NO_THINKING), ["hi <", "think>r", "</think", ">ok"])
    assert deltas == [("", "hi "), ("r", ""), ("", ""), ("", "ok")]
    # the end of the output releases what was held back
    assert _stream(R1(), ["abc</th"]) == [("abc</th", "")]


MARKER_BITS = ["<think>", "</think>", "<th", "ink>", "</th", "<", "/", ">", "a", "b", " ", "\n", "é"]
texts = st.lists(st.sampled_from(MARKER_BITS), max_size=14).map("".join)


@st.composite
def chunked(draw):
    text = draw(texts)
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=6))) if len(text) > 1 else []
    bounds = [0, *[c for c in cuts if 0 < c < len(text)], len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]


PARSERS = [R1, lambda: QWEN3(chat_template_kwargs=NO_THINKING), lambda: R1(prompt_text="</think>")]


@settings(max_examples=300, deadline=None)
@given(chunked(), st.sampled_from(range(len(PARSERS))))
def test_stream_adds_up_to_extract(case, which):
    text, chunks = case
    parser = PARSERS[which]()
    deltas = _stream(parser, chunks)
    reasoning_text = "".join(r for r, _ in deltas)
    content_text = "".join(c for _, c in deltas)
    assert (reasoning_text or None, content_text or None) == parser.extract(text)
    # before the end, what was emitted is a prefix of the final split (nothing is ever taken back), and no delta
    # leaves a partial marker that the final split does not contain at that place
    final_r, final_c = parser.extract(text)
    so_far_r = so_far_c = ""
    for r, c in deltas:
        so_far_r, so_far_c = so_far_r + r, so_far_c + c
        assert (final_r or "").startswith(so_far_r) and (final_c or "").startswith(so_far_c)


def test_a_parser_without_hold_back_fails_the_property(monkeypatch):
    """The property above catches a stream that emits a partial marker: "abc</th" as reasoning, then content."""
    import server.reasoning.base as base

    monkeypatch.setattr(base, "partial_suffix_len", lambda text, markers, start=0: 0)
    parser = R1()
    deltas = _stream(parser, ["abc</th", "ink>x"])
    assert "".join(r for r, _ in deltas) != parser.extract("abc</think>x")[0]


def test_partial_suffix_len():
    assert partial_suffix_len("abc</thi", ("</think>",)) == 5
    assert partial_suffix_len("abc</think>", ("</think>",)) == 0  # a whole marker is not a partial one
    assert partial_suffix_len("abc<", ("</think>", "<think>")) == 1
    assert partial_suffix_len("ab<th", ("</think>", "<think>")) == 3
    assert partial_suffix_len("<th", ("<think>",), start=1) == 0  # only text[start:] may be held
    assert partial_suffix_len("", ("<think>",)) == 0
