"""The engine's typed errors. `InvalidRequestError` carries the offending parameter, which the HTTP layer returns
as the OpenAI error's ``param``."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine's step loop died; no request can be served any more."""


class RequestFailedError(RuntimeError):
    """One request's own part of a step failed (its compression round, its sampling, its state); that request ends
    with this error (HTTP 500 naming the cause) and the engine goes on serving the others."""

    def __init__(self, where: str, cause: BaseException):
        super().__init__(f"this request failed in {where}: {type(cause).__name__}: {cause}")
        self.where = where
        self.cause = cause

    def __reduce__(self):  # pickled by the engine process (engine/process.py) to the HTTP process
        return type(self), (self.where, self.cause)
