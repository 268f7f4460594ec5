"""Errors in the OpenAI shape (``{"error": {message, type, param, code}}``, code = the HTTP status as in current
vLLM) and the text checks every body goes through (a lone surrogate is valid JSON but no text)."""
from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel


class RequestError(Exception):
    """An invalid request: rendered as an OpenAI error object with this status (400 unless told)."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400,
                 err_type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.err_type = err_type
        self.headers = headers



def _is_valid_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: valid JSON ("\ud800"), but no text
        return False
    return True


def printable(text: str) -> str:
    """`text` with lone surrogates escaped, so that it can go into a response body or a log line."""
    return text if _is_valid_text(text) else text.encode("utf-8", "backslashreplace").decode("utf-8")


def invalid_text_path(value: Any, path: tuple = ()) -> tuple | None:
    """The path to the first string (or object key) in a decoded JSON value that is not valid Unicode text."""
    if isinstance(value, str):
        return None if _is_valid_text(value) else path
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and not _is_valid_text(key):
                return path + (key,)
            found = invalid_text_path(item, path + (key,))
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = invalid_text_path(item, path + (i,))
            if found is not None:
                return found
    return None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                404: "NotFoundError", 405: "MethodNotAllowedError", 409: "ConflictError",
                413: "RequestEntityTooLargeError", 415: "UnsupportedMediaTypeError",
                422: "UnprocessableEntityError", 429: "RateLimitError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


def error_body(status_code: int, message: str, param: str | None = None, err_type: str | None = None) -> dict:
    """The OpenAI error object as a plain dict (code is the HTTP status, as in current vLLM)."""
    if err_type is None:
        err_type = _ERROR_TYPES.get(status_code, "InternalServerError" if status_code >= 500 else "BadRequestError")
    # a message may quote what the client sent: it must still encode as UTF-8
    return ErrorResponse(error=ErrorInfo(message=printable(message), type=err_type,
                                         param=printable(param) if param is not None else None,
                                         code=status_code)).model_dump()
