"""Request ids, as vLLM makes them: the client's ``X-Request-Id`` (else the body's ``request_id``, else a random id)
is the base of the response ``id`` (``cmpl-<base>``, ``chatcmpl-<base>``) and is echoed in the response header
(server/middleware.py). The engine refuses an id that is already running, and clients do reuse ids, so the engine
request ids add a process-wide serial: ``<response id>-<serial>-<prompt index>``."""
from __future__ import annotations

import itertools
from typing import Any

from api.protocol import random_uuid

REQUEST_ID_HEADER = "X-Request-Id"

_serial = itertools.count()  # process-wide: several apps may share one engine


def request_id_of(scope: Any) -> str | None:
    """The base id recorded for this request: the client's X-Request-Id, or what the handler chose (or None)."""
    return scope.get("state", {}).get("request_id")


def set_request_id(scope: Any, base: str | None) -> None:
    scope.setdefault("state", {})["request_id"] = base


def response_id(prefix: str, scope: Any, body_request_id: str | None) -> str:
    """``prefix-<base>``; the base is recorded so the echoed header matches the response's ``id``."""
    base = request_id_of(scope) or body_request_id or random_uuid()
    set_request_id(scope, base)
    return f"{prefix}-{base}"


def engine_ids(rid: str, count: int) -> list[str]:
    """Engine request ids for the `count` prompts of response `rid`. The two trailing fields are digits and the
    serial is never reused, so no two HTTP requests (same `rid` or a `rid` that mimics a suffix) share one."""
    serial = next(_serial)
    return [f"{rid}-{serial}-{i}" for i in range(count)]
