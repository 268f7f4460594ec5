"""Per-request sampling settings (vLLM's field names)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError


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
    skip_special_tokens: bool = True
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
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            bad("stop", f"must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop_strings = stop
        ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, int) and t >= 0 for t in ids):
            bad("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = ids
        self.kv_compression = _check_compression(self.kv_compression)
        from engine.structured_params import StructuredOutputsParams

        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_compression(value: Any) -> Any:
    """Each given field is checked now (errors name it) and the value kept as given: the engine resolves it once,
    against its own setting, when the request is made (`EngineCore.make_request`), and checks the rules between
    fields (buffer < window, ...) and the engine's limits then."""
    if value is None:
        return None
    from compression.config import coerce

    try:
        cfg = coerce(value, relations=False)
    except ValueError as err:
        raise InvalidRequestError(str(err), getattr(err, "param", None) or "kv_compression") from None
    return dict(value) if isinstance(value, dict) else (value if isinstance(value, str) else cfg)
