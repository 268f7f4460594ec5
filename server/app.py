"""The OpenAI-compatible FastAPI app (the routes): `build_app(engine, config=None, **settings)`, settings being
the fields of `server.config.ServerConfig`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health`` and
``GET|POST /ping`` (200 with an empty body, 503 once the engine loop died), ``GET /metrics`` (Prometheus text),
``GET /version``, ``POST /tokenize`` and ``POST /detokenize`` (server/tokenization.py).

In front of the routes (server/middleware.py): X-Request-Id (read, used as the response id's base, echoed), CORS,
the API key (401), the request-body size limit (413).

Request flow: validate (pydantic; every validation problem is a 400 in the OpenAI error shape, FastAPI's 422
never leaks) → model name (404) → engine health (503) → SamplingParams and prompt checks, once, by the engine (400)
→ admission (503 + ``Retry-After`` when more than ``max_queued_requests`` requests are waiting) → serving
(server/serving.py). Errors: server/errors.py.
"""
from __future__ import annotations

import logging
from typing import Any, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    RequestError,
)
from api.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from server import middleware
from server.chat import create_chat_completion
from server.config import ServerConfig
from server.errors import error_response, request_error_response, validation_error_response
from server.metrics import CONTENT_TYPE
from server.serving import create_completion
from server.state import ServerState
from server.tokenization import detokenize, tokenize

logger = logging.getLogger("kvllm.server")

try:
    from importlib.metadata import version as _pkg_version

    __version__ = _pkg_version("kvllm")
except Exception:  # running from a source tree that is not installed
    __version__ = "0.1.0"

_FASTAPI_BODY_ERROR = "There was an error parsing the body"

_ERROR_RESPONSES: dict[Union[int, str], dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key (when the server has one)"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    413: {"model": ErrorResponse, "description": "Request body over the server's limit"},
    503: {"model": ErrorResponse, "description": "Queue full or engine not running"},
}


# ============================================================================================ the app
def build_app(engine: Any, config: ServerConfig | None = None, **settings: Any) -> FastAPI:
    """An OpenAI-compatible app around a started-or-not `engine.Engine` (the engine is not owned: the caller
    shuts it down). ``config`` or keyword ``settings`` are `ServerConfig` fields: ``served_model_name`` (a name
    or a list; default ``engine.model_name``) is what ``/v1/models`` lists and what requests must name;
    ``max_queued_requests`` bounds the waiting requests (beyond it: 503 + Retry-After); ``chat_template``,
    ``generation_config`` (the default sampling parameters) and ``max_logprobs`` are vLLM's flags;
    ``reasoning_parser``, ``enable_auto_tool_choice`` and ``tool_call_parser`` read chat output (server/chat.py);
    the access, CORS, logging and metrics settings are described on the fields."""
    if config is None:
        config = ServerConfig(**settings)
    elif settings:
        raise TypeError("give a ServerConfig or keyword settings, not both")
    names = list(config.served_model_name or []) or [engine.model_name]
    state = ServerState(engine, names, config.max_queued_requests, config)

    app = FastAPI(title="kvllm", version=__version__,
                  description="OpenAI-compatible LLM server with paged KV cache and in-loop KV compression.")
    app.state.kvllm = state
    middleware.install(app, config)

    def openapi_schema() -> dict[str, Any]:
        """FastAPI's schema without the 422 responses it adds by default (validation errors are 400 here)."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    if isinstance(op, dict):
                        op.get("responses", {}).pop("422", None)
            comps = schema.get("components", {}).get("schemas", {})
            comps.pop("HTTPValidationError", None)
            comps.pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi_schema  # type: ignore[method-assign]

    # -- errors in the OpenAI shape ---------------------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        return validation_error_response(exc)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError):
        return request_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        detail = str(exc.detail)
        if detail == _FASTAPI_BODY_ERROR:  # FastAPI's answer when decoding the body raised (not a JSON error)
            detail = "Could not decode the request body as JSON (nested too deeply, or not text)."
        return error_response(exc.status_code, detail, None, None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        logger.exception("internal error")
        return error_response(500, f"Internal server error: {type(exc).__name__}: {exc}")

    # -- plain endpoints ----------------------------------------------------------------------------------
    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        if engine.is_healthy():
            return Response(status_code=200)
        return error_response(503, "The engine is not running (its step loop died).")

    @app.get("/ping", responses={503: {"model": ErrorResponse}})
    async def ping():
        """Same as /health (the SageMaker probe vLLM serves, GET and POST)."""
        return await health()

    app.post("/ping", responses={503: {"model": ErrorResponse}}, operation_id="ping_post")(ping)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    def _model_cards() -> list[ModelCard]:
        return [ModelCard(id=name, created=state.created, root=engine.model_name,
                          max_model_len=engine.max_model_len) for name in names]

    @app.get("/v1/models", response_model=ModelList)
    async def list_models():
        return ModelList(data=_model_cards())

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
    async def get_model(model_id: str):
        for card in _model_cards():
            if card.id == model_id:
                return card
        raise RequestError(f"The model `{model_id}` does not exist.", "model", 404)

    # Health checkers that probe with HEAD must not see a dead server (405): the same answers, without a body.
    for path, handler in (("/health", health), ("/ping", ping), ("/v1/models", list_models)):
        app.add_api_route(path, handler, methods=["HEAD"], include_in_schema=False)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERROR_RESPONSES)
    async def tokenize_route(body: TokenizeRequest):
        return tokenize(state, body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERROR_RESPONSES)
    async def detokenize_route(body: DetokenizeRequest):
        return detokenize(state, body)

    _stream_doc = {200: {"content": {"application/json": {}, "text/event-stream": {}}}}

    # -- completions and chat (server/serving.py) ---------------------------------------------------------
    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**_ERROR_RESPONSES, **_stream_doc})
    async def completions(body: CompletionRequest, raw: Request):
        return await create_completion(state, body, raw)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**_ERROR_RESPONSES, **_stream_doc})
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(state, body, raw)

    return app
