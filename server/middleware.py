"""The HTTP layers in front of the routes (pure ASGI, so streaming responses pass through untouched).

Order, outermost first (`install`): request id → CORS (starlette's) → API key → body size limit → routes. CORS sits
outside the key check so a browser can read a 401's body, and the key is checked before any body byte is read.
Every error here is an OpenAI error object (server/errors.py).
"""
from __future__ import annotations

import hashlib
import secrets
from typing import Any

from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.protocol import random_uuid, request_id_problem
from server.errors import error_response
from server.request_ids import REQUEST_ID_HEADER, request_id_of, set_request_id
#: Reachable without the API key, as in vLLM: probes, metrics scraping and the API docs.
PUBLIC_PATHS = ("/health", "/ping", "/version", "/metrics", "/docs", "/redoc", "/openapi.json")


class RequestIdMiddleware:
    """Records the client's X-Request-Id for the handler (server/request_ids.py) and echoes it, or the id the
    handler chose, or a fresh one, in the response header. An id that is too long or not visible ASCII is a 400
    (as a body ``request_id`` is): echoing it would be a huge or unencodable header, and a changed id would no
    longer be the client's."""

    def __init__(self, app: ASGIApp, echo: bool = True):
        self.app = app
        self.echo = echo

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = (Headers(scope=scope).get(REQUEST_ID_HEADER) or "").strip() or None
        problem = None if given is None else request_id_problem(given)
        set_request_id(scope, None if problem else given)
        if problem:
            response = error_response(400, f"{REQUEST_ID_HEADER} header {problem}", REQUEST_ID_HEADER)
            return await response(scope, receive, self._sender(scope, send))
        await self.app(scope, receive, self._sender(scope, send))

    def _sender(self, scope: Scope, send: Send) -> Send:
        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start" and self.echo:
                rid = request_id_of(scope) or random_uuid()
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            await send(message)

        return send_with_id


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _is_public(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in PUBLIC_PATHS)


class ApiKeyMiddleware:
    """Bearer-token check on every path except `PUBLIC_PATHS` (unknown paths included: fail closed). Keys are
    compared as SHA-256 digests with `secrets.compare_digest`, over all keys, so the time taken says nothing about
    how much of a key matched or which key it was."""

    def __init__(self, app: ASGIApp, keys: list[str]):
        self.app = app
        self.digests = [_digest(k) for k in keys]

    def authorized(self, headers: Headers) -> bool:
        scheme, _, token = (headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = _digest(token.strip())
        ok = False
        for d in self.digests:
            ok |= secrets.compare_digest(given, d)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":  # CORS preflights carry no credentials
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if _is_public(path) or self.authorized(Headers(scope=scope)):
            return await self.app(scope, receive, send)
        response = error_response(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                                  headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """413 for a body over `limit` bytes: at once from Content-Length, or, for a chunked body, as soon as the bytes
    received pass the limit (the body is then read here first, and replayed to the route)."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    def too_large(self) -> Any:
        return error_response(413, f"The request body is larger than the server's limit of {self.limit} bytes "
                                   f"(max_request_body_size).")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.limit:
                return await self.too_large()(scope, receive, send)
            return await self.app(scope, receive, send)  # the server stops at Content-Length bytes
        try:
            body = await self._read(receive)
        except BodyTooLarge:
            return await self.too_large()(scope, receive, send)
        if body is not None:  # None: the client left before sending it all; nobody to answer
            await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | None:
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                raise BodyTooLarge()
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The buffered body as one message, then the real channel (for the disconnect that ends a request)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def install(app: Any, config: Any) -> None:
    """Wrap `app` in the layers `config` (a `ServerConfig`) asks for; the last one added runs first."""
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_body_size)
    keys = config.api_keys
    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=keys)
    app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=config.allowed_methods,
                       allow_headers=config.allowed_headers, allow_credentials=config.allow_credentials)
    app.add_middleware(RequestIdMiddleware, echo=config.enable_request_id_headers)
