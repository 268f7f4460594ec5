"""``--reasoning-parser qwen3`` (Qwen3 and later Qwen thinking models).

Current vLLM semantics: Qwen3.5's template opens the think block in the prompt and older Qwen3 templates let the
model write ``<think>`` itself, so both are read like deepseek_r1: text before the first ``</think>`` is reasoning
(a generated ``<think>`` is dropped), text after it is content, and an output that never closes the block was cut
off while thinking (all reasoning). Thinking is switched off by ``chat_template_kwargs: {"enable_thinking":
false}`` (the template then writes an empty block into the prompt): then only an explicit ``<think>`` …
``</think>`` pair in the output is reasoning and everything else is content.

Not handled: Qwen3.5's XML tool calls (``<tool_call><function=...>``) ending a think block without ``</think>``;
kvllm parses the hermes JSON tool-call format only.
"""
from __future__ import annotations

from typing import Any

from server.reasoning.base import ReasoningParser
from server.reasoning.registry import register


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def explicit(self, chat_template_kwargs: dict[str, Any]) -> bool:
        return chat_template_kwargs.get("enable_thinking", True) is False


register(Qwen3ReasoningParser)
