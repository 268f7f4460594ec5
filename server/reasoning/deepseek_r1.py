"""``--reasoning-parser deepseek_r1`` (DeepSeek-R1 and its distillations, QwQ).

Their chat templates open the think block in the prompt (``<|Assistant|><think>\\n``), so the output starts inside
it: everything before the first ``</think>`` is reasoning, even without a generated ``<think>`` (one that is
generated is dropped), and everything after it is content. An output that never closes the block was cut off while
thinking: all of it is reasoning. A prompt that already closed the block leaves only an explicit
``<think>`` … ``</think>`` pair as reasoning (server/reasoning/base.py).
"""
from __future__ import annotations

from server.reasoning.base import ReasoningParser
from server.reasoning.registry import register


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


register(DeepSeekR1ReasoningParser)
