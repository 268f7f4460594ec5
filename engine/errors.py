"""The engine's typed errors. `InvalidRequestError` carries the offending parameter, which the HTTP layer returns
as the OpenAI error's ``param``."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine's step loop died; no request can be served any more."""
