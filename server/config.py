"""The HTTP server's settings (`ServerConfig`), each declared once with its flag (engine/argspec.py): `kvllm serve`
generates its server flags from these fields, and `build_app(engine, config)` reads them."""
from __future__ import annotations

from dataclasses import dataclass

from engine.argspec import setting


@dataclass
class ServerConfig:
    served_model_name: list[str] | None = setting(
        None, parse=str, nargs="+",
        help="name(s) clients use as 'model' (default: 'smollm2' or the model path's basename)")
    max_queued_requests: int | None = setting(
        None, help="reject with 503 + Retry-After while this many requests wait (default: unbounded)")

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests!r}")
