"""The HTTP edge every chapter shares: OpenAI's error envelope, the middlewares, `new_app` (ch01).

- `APIError`: an error that leaves in OpenAI's envelope with its status;
  FastAPI's 422 becomes a 400 naming the `param` (`validation_error`);
- `CatchServerErrors`: an unexpected exception is a 500 that keeps the
  connection open; `BodySizeLimit`: a body over 1 MiB is a 413;
- `APIKeyCheck` (ch06, `--api-key`): 401 without the key, on every route
  but those vLLM leaves open;
- `RateLimit` (ch03): a few answers a second on the monitoring routes;
- `cancel_on_disconnect`: a request's work, cancelled if its client
  hangs up (a non-streaming answer; a stream sees it by itself);
- `new_app` installs all of it, and fixes the OpenAPI schema to say so.

Left out: CORS, TLS (put a reverse proxy in front), per-client rate limits.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Awaitable
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.entrypoints.responses import ErrorInfo, ErrorResponse

log = logging.getLogger("llm-course")

DISCONNECT_POLL_S = 0.25
MAX_BODY_BYTES = 1 << 20  # 1 MiB: a full 8192-token prompt is ~40 KB of JSON
# What --api-key leaves open, as vLLM does: load balancers, Prometheus, the
# docs. Every other route, `/stats` and any route added later, needs the key.
PUBLIC_PATHS = frozenset({"/health", "/ping", "/load", "/metrics", "/version", "/docs",
                          "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
LIVE_VIEW_STREAM = "/ui/events"  # the live view's data; its page (/ui/...) is public


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or (path == "/ui" or path.startswith("/ui/")) and path != LIVE_VIEW_STREAM


# ------------------------------------------------------------------ errors
class APIError(Exception):
    """An error that goes back to the client in OpenAI's envelope."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def internal_error(exc: BaseException) -> APIError:
    return APIError(500, f"{type(exc).__name__}: {exc}", "internal_server_error")


def _param(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content', 'str') -> 'messages.0.content': the
    field path, without pydantic's union-member and validator tags."""
    parts = [str(p) for p in loc if p != "body"]
    fields = [p for p in parts if p.isidentifier() and p not in TYPE_TAGS or p.isdigit()]
    return ".".join(fields) or None


TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 -> our 400: the most telling error, and its field."""
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return APIError(400, "We could not parse the JSON body of your request. "
                        f"({errors[0].get('msg')})")
    # A value refused on its merits says more than "not a list" from the
    # other members of a Union.
    first = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    param = _param(first.get("loc", ()))
    if param is None:  # the body itself: empty, an array, not JSON's content type
        return APIError(400, "The request body must be a JSON object (Content-Type: "
                        f"application/json): {first['msg']}.")
    if first["type"] == "unsupported":
        return APIError(400, first["msg"], param=param)
    if first["type"] == "extra_forbidden":  # a server that accepts only what it implements
        return APIError(400, f"`{param}` is not implemented by this server.", param=param)
    return APIError(400, f"Invalid value for '{param}': {first['msg']}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    """APIError, validation errors and HTTP errors leave in the envelope."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind).response()


# --------------------------------------------------------- ASGI middleware
class CatchServerErrors:
    """An unexpected exception becomes a 500 in the envelope, and the
    connection stays open for the client's next request.

    (FastAPI's `exception_handler(Exception)` answers too, but Starlette
    re-raises the exception afterwards, and uvicorn then drops the
    keep-alive connection.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - answered here, logged with its traceback
            log.exception("error while serving %s", scope.get("path"))
            if started:  # too late for a status code: the client sees a cut response
                return
            await internal_error(exc).response()(scope, receive, send)


class BodySizeLimit:
    """413 for a body over `max_bytes`, counted as it arrives (a client may
    send no Content-Length). An oversized body is drained, not kept, so the
    client reads our answer instead of a reset connection."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # client gone before the body ended
                return
            size += len(message.get("body", b""))
            if size <= self.max_bytes:
                body.append(message.get("body", b""))
            more = message.get("more_body", False)
        if size > self.max_bytes:
            error = APIError(413, f"Request body too large: {size} bytes; the limit is "
                             f"{self.max_bytes} bytes.", code="request_too_large")
            return await error.response()(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # later calls: wait for the disconnect
            replayed = True
            return {"type": "http.request", "body": b"".join(body), "more_body": False}

        await self.app(scope, replay, send)


class APIKeyCheck:
    """`--api-key`: every route but PUBLIC_PATHS needs `Authorization:
    Bearer KEY` (default-deny: `/stats` shows the engine's state and the
    prefix-cache hits, which can hint at other users' prompts). The live
    view's page is public like /docs (code, no data); its stream
    (/ui/events) takes the key as `?key=KEY` too. The scheme
    is case-insensitive (RFC 7235), the key compared in constant time."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not is_public(scope["path"]):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" and scope["path"] == LIVE_VIEW_STREAM:
                scheme, given = b"bearer", self.key_in_url(scope)
            if scheme.lower() != b"bearer" or not secrets.compare_digest(given, self.expected):
                error = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)

    @staticmethod
    def key_in_url(scope) -> bytes:
        """`?key=KEY`: a browser's EventSource cannot send a header."""
        values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("key", [""])
        return values[0].encode()


class RateLimit:
    """At most `per_second` answers a second on the routes that share it,
    all clients together; a request beyond that waits its turn on the event
    loop (asleep: no thread, no CPU). Why: once `/stats` answers at once, 60
    clients looping on it would take the CPU from the engine (on 2 cores,
    a long request beside them ran many times slower); a monitor needs a
    few answers a second, not thousands."""

    def __init__(self, per_second: float):
        self.interval = 1.0 / per_second
        self.next_slot = 0.0

    async def wait(self) -> None:
        now = time.monotonic()
        slot = max(now, self.next_slot)  # the first free slot, reserved at once
        self.next_slot = slot + self.interval
        await asyncio.sleep(slot - now)


async def cancel_on_disconnect(request: Request, work: Awaitable):
    """Await `work`, but cancel it if the client hangs up first: a dropped
    non-streaming request frees its engine's blocks (or, through the
    router, closes its connection to the replica, which does the same)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                log.info("client disconnected: aborting %s", request.url.path)
                raise APIError(499, "client disconnected")
    finally:
        task.cancel()


# -------------------------------------------------------------------- app
ERROR_RESPONSES = {status: {"model": ErrorResponse, "description": description}
                   for status, description in [
                       (400, "Invalid request (OpenAI's error envelope)"),
                       (413, "Request body too large"),
                       (500, "Internal error (the server keeps serving)")]}


def _openapi_schema(app: FastAPI) -> dict:
    """FastAPI documents a 422 for every body; this server answers 400."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def new_app(title: str, version: str = "0", disable_docs: bool = False,
            max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """A FastAPI app whose every error leaves in OpenAI's envelope.
    `disable_docs`: no /docs, /redoc, /openapi.json (vLLM's
    --disable-fastapi-docs)."""
    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} if disable_docs else {}
    app = FastAPI(title=title, version=version, responses=ERROR_RESPONSES, **docs)
    install_error_handlers(app)
    app.add_middleware(CatchServerErrors)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.openapi = lambda: _openapi_schema(app)
    return app
