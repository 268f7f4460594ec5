"""How one chat request's output is read: the reasoning parser first (``--reasoning-parser``), then, on the content
it leaves, the tool-call parser that ``tool_choice`` selects (none; the server's ``--tool-call-parser`` for
"auto"; the forced-call parsers for "required" and named ones). Tool calls are only looked for in the content,
never in the reasoning (as in vLLM).

`OutputPlan` is decided once per request (server/chat.py); each choice gets its own `ChoiceReader`, which keeps
the texts seen so far so the pure parsers can be asked for each stream delta.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from api.tools import NamedToolChoice
from server.reasoning.base import ReasoningParser
from server.tools.base import ParsedToolCall, ToolCallDelta, ToolParser
from server.tools.forced import NamedToolParser, RequiredToolParser


@dataclass
class ParsedOutput:
    reasoning: str | None
    content: str | None
    calls: list[ParsedToolCall] = field(default_factory=list)


@dataclass
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass
class OutputPlan:
    """What to do with a request's output. ``reasoning``/``tools`` make a fresh parser per choice (None: no
    parsing); ``forced``: tool_choice required or named; ``tool_calls_finish``: a choice that made calls
    finishes with "tool_calls" (not for a named call, as in OpenAI's API); ``one_call``: parallel_tool_calls
    false; ``hide_reasoning``: include_reasoning false."""

    reasoning: Callable[[], ReasoningParser] | None = None
    tools: Callable[[], ToolParser] | None = None
    forced: bool = False
    tool_calls_finish: bool = False
    one_call: bool = False
    hide_reasoning: bool = False

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def reader(self) -> "ChoiceReader":
        return ChoiceReader(self.reasoning() if self.reasoning else None, self.tools() if self.tools else None,
                            self)

    def finish_reason(self, made_calls: bool, finish_reason: str | None) -> str | None:
        return "tool_calls" if made_calls and self.tool_calls_finish and finish_reason == "stop" else finish_reason


def make_plan(*, reasoning_cls: type[ReasoningParser] | None, prompt_text: str,
              chat_template_kwargs: dict[str, Any] | None, tool_choice: Any,
              auto_parser: type[ToolParser] | None, parallel_tool_calls: bool, include_reasoning: bool) -> OutputPlan:
    """The plan for a request whose effective ``tool_choice`` is given ("auto" needs ``auto_parser``)."""
    plan = OutputPlan(one_call=not parallel_tool_calls, hide_reasoning=not include_reasoning)
    if reasoning_cls is not None:
        plan.reasoning = lambda: reasoning_cls(prompt_text, chat_template_kwargs)
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        plan.tools, plan.forced = (lambda: NamedToolParser(name)), True
    elif tool_choice == "required":
        plan.tools, plan.forced, plan.tool_calls_finish = RequiredToolParser, True, True
    elif tool_choice == "auto" and auto_parser is not None:
        plan.tools, plan.tool_calls_finish = auto_parser, True
    return plan


class ChoiceReader:
    """One choice's output read through the plan's parsers, whole (`full`) or delta by delta (`feed`)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, plan: OutputPlan):
        self.reasoning_parser, self.tool_parser, self.plan = reasoning, tools, plan
        self.text = ""  # the output so far
        self.content = ""  # the reasoning parser's content so far: the tool parser's input
        self.made_calls = False

    def full(self, text: str) -> ParsedOutput:
        reasoning, content = self.reasoning_parser.extract(text) if self.reasoning_parser else (None, text)
        calls: list[ParsedToolCall] = []
        if self.tool_parser is not None:
            content, calls = self.tool_parser.extract(content or "")
            if self.plan.one_call:
                calls = calls[:1]
        self.made_calls = bool(calls)
        return ParsedOutput(None if self.plan.hide_reasoning else reasoning, content, calls)

    def feed(self, delta_text: str, final: bool) -> OutputDelta:
        previous = self.text
        self.text += delta_text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.delta(previous, self.text, delta_text, final)
        else:
            reasoning, content = "", delta_text
        calls: list[ToolCallDelta] = []
        if self.tool_parser is not None:
            before = self.content
            self.content += content
            content, calls = self.tool_parser.delta(before, self.content, content, final)
            if self.plan.one_call:
                calls = [c for c in calls if c.index == 0]
            self.made_calls = self.made_calls or bool(calls)
        return OutputDelta("" if self.plan.hide_reasoning else reasoning, content, calls)
