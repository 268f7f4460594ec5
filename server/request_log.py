"""Per-request log lines (``--enable-log-requests``, vLLM's meaning): one line when a request is accepted, with its
id, prompt (cut to ``max_log_len`` characters / token ids) and sampling parameters."""
from __future__ import annotations

import logging
from typing import Any


def _cut(value: Any, limit: int | None) -> Any:
    return value if limit is None or value is None else value[:limit]


def log_request(logger: logging.Logger, req: Any, max_log_len: int | None) -> None:
    """``req``: an `engine.request.Request` (encoded and validated)."""
    logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", req.request_id,
                _cut(req.prompt, max_log_len), req.params, _cut(req.prompt_token_ids, max_log_len))
