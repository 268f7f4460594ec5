"""The HTTP server's settings (`ServerConfig`), each declared once with its flag (engine/argspec.py): `kvllm serve`
generates its server flags from these fields, and `build_app(engine, config)` reads them.

Names and value formats follow vLLM's frontend flags where vLLM has one (``--api-key``, ``--allowed-origins
'["*"]'``, ``--enable-log-requests`` ...), so a vLLM launch line keeps working."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from engine.argspec import setting
from engine.chat_template import load_chat_template
from engine.config import parse_memory
from engine.generation_config import sampling_defaults
from server import reasoning, tools

#: Environment variable read for the API key when ``api_key`` is not given (vLLM's name).
API_KEY_ENV = "VLLM_API_KEY"
METRICS_PREFIXES = ("vllm", "kvllm", "both")
DEFAULT_MAX_REQUEST_BODY = 32 * 2**20


def json_str_list(text: str) -> list[str]:
    """An argparse type: a JSON list of strings, e.g. '["http://a.example", "http://b.example"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, e.g. '[\"*\"]': {err}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
    return value


def byte_size(text: str) -> int:
    """An argparse type: bytes, or a size such as '32MiB'."""
    try:
        return parse_memory(int(text) if text.strip().isdigit() else text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _all_origins() -> list[str]:
    return ["*"]


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
    # -- access ---------------------------------------------------------------------------------------------
    api_key: list[str] | None = setting(
        None, parse=str, nargs="+", metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' (one of these keys) on every route but /health, /ping, "
             f"/version, /metrics and the docs; 401 otherwise. Without the flag, ${API_KEY_ENV} is used if set")
    allowed_origins: list[str] = setting(
        default_factory=_all_origins, parse=json_str_list, metavar="JSON",
        help="CORS: allowed origins, a JSON list (vLLM's format), e.g. '[\"https://app.example\"]'")
    allowed_methods: list[str] = setting(default_factory=_all_origins, parse=json_str_list, metavar="JSON",
                                         help="CORS: allowed methods, a JSON list")
    allowed_headers: list[str] = setting(default_factory=_all_origins, parse=json_str_list, metavar="JSON",
                                         help="CORS: allowed request headers, a JSON list")
    allow_credentials: bool = setting(False, help="CORS: allow credentials (cookies, Authorization)")
    max_request_body_size: int = setting(
        DEFAULT_MAX_REQUEST_BODY, parse=byte_size, metavar="BYTES",
        help="reject request bodies larger than this (bytes or a size like '64MiB') with 413; vLLM has no such "
             "limit, so this is generous")
    enable_request_id_headers: bool = setting(
        True, help="echo X-Request-Id on every response (the client's, or the id the server made); vLLM's flag, "
                   "but on by default here")
    # -- logs and metrics -----------------------------------------------------------------------------------
    enable_log_requests: bool = setting(False, help="log one line per request (its id, prompt and parameters)")
    disable_log_requests: bool = setting(
        False, help="vLLM's older flag: no per-request log lines (the default; overrides --enable-log-requests)")
    max_log_len: int | None = setting(
        None, help="per-request log lines show at most this many prompt characters / token ids (none: all)")
    metrics_prefix: str = setting(
        "both", choices=METRICS_PREFIXES,
        help="/metrics series names: 'vllm:' (vLLM dashboards and routers), 'kvllm:', or both with the same "
             "suffixes and labels")
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
        if isinstance(self.api_key, str):
            self.api_key = [self.api_key]
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests!r}")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= -1, got {self.max_logprobs!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        # fail at startup, not at the first request: a template path that does not open, a folder without the file
        load_chat_template(self.chat_template)
        if self.generation_config not in ("auto", "vllm"):
            sampling_defaults(self.generation_config, None)
        if self.api_key is not None and (not self.api_key or not all(isinstance(k, str) and k
                                                                     for k in self.api_key)):
            raise ValueError("api_key must be one or more non-empty strings")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{name} must be a list of strings, got {value!r}")
        if not isinstance(self.max_request_body_size, int) or self.max_request_body_size < 1:
            raise ValueError(f"max_request_body_size must be a positive number of bytes, "
                             f"got {self.max_request_body_size!r}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {self.max_log_len!r}")
        if self.metrics_prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics_prefix must be one of {list(METRICS_PREFIXES)}, got {self.metrics_prefix!r}")
        if self.reasoning_parser is not None:
            reasoning.get(self.reasoning_parser)
        if self.tool_call_parser is not None:
            tools.get(self.tool_call_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the model's tool-call format)")

    @property
    def api_keys(self) -> list[str]:
        """The keys clients must present: ``api_key``, else $VLLM_API_KEY, else none (no auth)."""
        if self.api_key:
            return list(self.api_key)
        env = os.environ.get(API_KEY_ENV, "")
        return [env] if env else []

    @property
    def log_requests(self) -> bool:
        return self.enable_log_requests and not self.disable_log_requests

    @property
    def metric_prefixes(self) -> tuple[str, ...]:
        return ("vllm:", "kvllm:") if self.metrics_prefix == "both" else (self.metrics_prefix + ":",)
