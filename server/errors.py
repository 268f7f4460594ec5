"""Errors in the OpenAI shape: the JSON response, the SSE error event, pydantic validation errors as 400s, and the
mapping from the engine's typed errors."""
from __future__ import annotations

import json

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from api.protocol import RequestError, error_body
from engine.errors import EngineDeadError, InvalidRequestError


def error_response(status_code: int, message: str, param: str | None = None, err_type: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status_code, message, param, err_type), status_code=status_code,
                        headers=headers)


def request_error_response(err: RequestError) -> JSONResponse:
    return error_response(err.status_code, err.message, err.param, err.err_type, err.headers)


def to_request_error(exc: BaseException) -> RequestError | None:
    """The HTTP error for an engine-side failure, or None for an unexpected one (a 500)."""
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return RequestError(str(exc), exc.param)
    if isinstance(exc, EngineDeadError):
        return RequestError(f"The engine is not running: {exc}", None, 503)
    return None


def error_event(err: BaseException) -> str:
    """An error after a stream started: one SSE event carrying the OpenAI error object."""
    mapped = to_request_error(err)
    if mapped is not None:
        body = error_body(mapped.status_code, mapped.message, mapped.param, mapped.err_type)
    else:
        body = error_body(500, f"Internal server error: {type(err).__name__}: {err}")
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "bytes"}


def _clean_loc(loc) -> list[str]:
    """Field path of a pydantic error without "body" and union-member tags ("str", "list[int]", "Model")."""
    out = []
    for x in loc:
        x = str(x)
        if x == "body" and not out:
            continue
        if x in _TYPE_TAGS or "[" in x or "-" in x or (x[:1].isupper() and x.isidentifier()):
            continue
        out.append(x)
    return out


def format_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message and the offending parameter of a pydantic validation error."""
    errors = exc.errors()
    if not errors:
        return "Invalid request", None
    for err in errors:
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return f"Invalid JSON in the request body{': ' + str(detail) if detail else ''}", None
    for err in errors:
        if err.get("type") in ("invalid_unicode", "too_deep"):  # the body checks name the place (api/protocol.py)
            return str(err.get("msg")), (err.get("ctx") or {}).get("param")
    items = []
    for i, err in enumerate(errors):
        loc = _clean_loc(err.get("loc", ()))
        if not loc and err.get("type") in ("model_attributes_type", "dict_type", "missing"):
            return "The request body must be a JSON object (Content-Type: application/json).", None
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        wrong_type = str(err.get("type", "")).endswith("_type")
        items.append((wrong_type, -len(loc), i, ".".join(loc), msg))
    # For a union, the member that got furthest explains best: constraint errors before type mismatches
    # (which mostly come from the other members), then the deepest location.
    items.sort()
    param = items[0][3] or None
    parts, seen = [], set()
    for _, _, _, where, msg in items:
        text = f"{where}: {msg}" if where else msg
        if text not in seen:
            seen.add(text)
            parts.append(text)
    more = f" (and {len(parts) - 3} more)" if len(parts) > 3 else ""
    return "; ".join(parts[:3]) + more, param


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    message, param = format_validation_error(exc)
    return error_response(400, message, param)


__all__ = ["error_response", "request_error_response", "to_request_error", "error_event",
           "format_validation_error", "validation_error_response"]
