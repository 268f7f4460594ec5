"""Per-request sampling settings (vLLM's field names)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError
from engine.structured_params import StructuredOutputsParams


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: just the sampled one)
    prompt_logprobs: int | None = None  # top logprobs per prompt token (0: just the prompt's own); None: none
    skip_special_tokens: bool = True
    # vLLM's penalties and filters (engine/logits_processors.py, engine/sampler.py)
    presence_penalty: float = 0.0  # [-2, 2]: minus this once for every token already in the output
    frequency_penalty: float = 0.0  # [-2, 2]: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # (0, 2]: a token of the prompt or output: positive logit / it, negative x it
    min_p: float = 0.0  # [0, 1]: tokens less probable than min_p x the most probable one are dropped
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> bias added to its logit, clamped to ±100
    # KV compression for this request: None uses the engine's setting; "none" disables; a method name, a dict of
    # fields or a compression.KVCompressionConfig overrides it (omitted fields keep the engine's values).
    kv_compression: Any = None
    # Structured outputs (vLLM's name): an engine.structured.StructuredOutputsParams or a dict of its fields
    # (json, regex, choice, grammar, json_object); the engine compiles it when the request is made.
    structured_outputs: Any = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str):
            raise InvalidRequestError(f"{name} {why}", name)

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -2**63 <= self.seed < 2**63):
            bad("seed", f"must be a 64-bit integer, got {self.seed!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):  # the engine bounds them by the vocabulary
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                bad(name, f"must be an integer >= 0, got {value!r}")
        for name, lo, hi, lo_open in (("presence_penalty", -2.0, 2.0, False), ("frequency_penalty", -2.0, 2.0, False),
                                      ("repetition_penalty", 0.0, 2.0, True), ("min_p", 0.0, 1.0, False)):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi
                    or (lo_open and value == lo)):
                bad(name, f"must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value!r}")
            setattr(self, name, float(value))
        self.logit_bias = _check_logit_bias(self.logit_bias)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            bad("stop", f"must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop_strings = stop
        ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, int) and t >= 0 for t in ids):
            bad("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = ids
        self.kv_compression = _check_compression(self.kv_compression)
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _check_logit_bias(value: Any) -> dict[int, float] | None:
    """{token id: bias}: ids as ints (JSON keys arrive as strings), biases clamped to [-100, 100] as in vLLM."""
    if not value:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"logit_bias must be an object of token id: bias, got {value!r}", "logit_bias")
    out = {}
    for key, bias in value.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            tid = -1
        if tid < 0 or isinstance(key, bool) or isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or bias != bias:
            raise InvalidRequestError(f"logit_bias must map token ids (integers >= 0) to numbers, got "
                                      f"{key!r}: {bias!r}", "logit_bias")
        out[tid] = min(100.0, max(-100.0, float(bias)))
    return out


def _check_compression(value: Any) -> Any:
    """Each given field is checked now (errors name it) and the value kept as given: the engine resolves it once,
    against its own setting, when the request is made (`EngineCore.make_request`), and checks the rules between
    fields (buffer < window, ...) and the engine's limits then."""
    if value is None:
        return None
    from compression.config import coerce  # `import engine` stays free of torch (engine/threads.py)

    try:
        cfg = coerce(value, relations=False)
    except ValueError as err:
        raise InvalidRequestError(str(err), getattr(err, "param", None) or "kv_compression") from None
    return dict(value) if isinstance(value, dict) else (value if isinstance(value, str) else cfg)
