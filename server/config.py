"""The HTTP server's settings (`ServerConfig`), each declared once with its flag (engine/argspec.py): `kvllm serve`
generates its server flags from these fields, and `build_app(engine, config)` reads them."""
from __future__ import annotations

from dataclasses import dataclass

from engine.argspec import setting
from server import reasoning, tools


@dataclass
class ServerConfig:
    served_model_name: list[str] | None = setting(
        None, parse=str, nargs="+",
        help="name(s) clients use as 'model' (default: 'smollm2' or the model path's basename)")
    max_queued_requests: int | None = setting(
        None, help="reject with 503 + Retry-After while this many requests wait (default: unbounded)")
    reasoning_parser: str | None = setting(
        None, choices=tuple(reasoning.names()),
        help="split chat output into reasoning_content and content (vLLM's parser names)")
    enable_auto_tool_choice: bool = setting(
        False, help="let the model call tools on its own (tool_choice 'auto'); needs --tool-call-parser")
    tool_call_parser: str | None = setting(
        None, choices=tuple(tools.names()), help="the model's tool-call format (hermes: Hermes, Qwen2.5, Qwen3)")

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests!r}")
        if self.reasoning_parser is not None:
            reasoning.get(self.reasoning_parser)
        if self.tool_call_parser is not None:
            tools.get(self.tool_call_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the model's tool-call format)")
