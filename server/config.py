"""The HTTP server's settings (`ServerConfig`), each declared once with its flag (engine/argspec.py): `kvllm serve`
generates its server flags from these fields, and `build_app(engine, config)` reads them."""
from __future__ import annotations

from dataclasses import dataclass

from engine.argspec import setting


@dataclass
class ServerConfig:
    served_model_name: list[str] | None = setting(
        None, parse=str, nargs="+",
        help="name(s) clients use as 'model' (default: 'smollm2', the Hub id, or the model path's basename)")
    max_queued_requests: int | None = setting(
        None, help="reject with 503 + Retry-After while this many requests wait (default: unbounded)")
    chat_template: str | None = setting(
        None, metavar="FILE|TEMPLATE",
        help="chat template of /v1/chat/completions: a file path or the Jinja template itself (default: the "
             "tokenizer's)")
    generation_config: str = setting(
        "auto", metavar="auto|vllm|FOLDER",
        help="default sampling parameters for requests that leave them unset: 'auto' reads the model's "
             "generation_config.json (its max_new_tokens caps every request's output), 'vllm' uses the built-in "
             "defaults, a folder is read instead of the model's")
    max_logprobs: int = setting(
        20, help="most top logprobs a request may ask for (logprobs, top_logprobs); -1: no limit of the server's")

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests!r}")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= -1, got {self.max_logprobs!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        # fail at startup, not at the first request: a template path that does not open, a folder without the file
        from engine.chat_template import load_chat_template
        from engine.generation_config import sampling_defaults

        load_chat_template(self.chat_template)
        if self.generation_config not in ("auto", "vllm"):
            sampling_defaults(self.generation_config, None)
