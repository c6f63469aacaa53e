"""vLLM's extra routes beside OpenAI's (ch06): what deployments built for vLLM call.

- `POST /invocations` and `/ping` (SageMaker's hosting contract, as vLLM
  serves it): `/invocations` takes a chat or a text completion request,
  whichever the body validates as (chat first), and answers as that
  route would; a body that is neither is a 400 naming both. `/ping` is
  `/health`.
- `GET /load` (`--enable-server-load-tracking`): `{"server_load": N}`, the
  requests in flight on the generating routes (a stream counts until its
  last byte), for a load balancer that prefers the least busy server.
  Without the flag it says 0, as vLLM does.
- `GET /tokenizer_info` (`--enable-tokenizer-info-endpoint`, off by
  default as in vLLM: it shows the chat template): the tokenizer's
  settings, its class and the chat template.

Left out: SageMaker's stateful sessions and adapter ids, the pooling
requests `/invocations` also takes in vLLM (embeddings, scores).
"""
from __future__ import annotations

import json
from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError

from common.entrypoints.middleware import APIError

GENERATING_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/invocations"})

Handler = Callable[[BaseModel, Request], Awaitable]


class ServerLoadTracking:
    """ASGI middleware: counts the requests in flight on the generating
    routes in `app.state.server_load_metrics` (vLLM's name)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in GENERATING_ROUTES:
            return await self.app(scope, receive, send)
        state = scope["app"].state
        state.server_load_metrics += 1
        try:
            await self.app(scope, receive, send)  # returns once the last byte is sent
        finally:
            state.server_load_metrics -= 1


def add_vllm_routes(app: FastAPI, handlers: dict[type[BaseModel], Handler],
                    health: Callable[[], dict], load_tracking: bool = False,
                    tokenizer=None) -> None:
    """`handlers`: each request model /invocations may take, in the order
    it tries them, and its route's handler. `tokenizer`: serve
    /tokenizer_info (None: no such route)."""
    app.state.server_load_metrics = 0
    if load_tracking:
        app.add_middleware(ServerLoadTracking)

    @app.post("/invocations")
    async def invocations(request: Request):
        body = await request.json()
        for model, handler in handlers.items():
            try:
                parsed = model.model_validate(body)
            except ValidationError:
                continue
            return await handler(parsed, request)
        names = [model.__name__ for model in handlers]
        raise APIError(400, "Cannot find suitable handler for request. "
                            f"Expected one of: {names}")

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> dict:
        return health()

    @app.get("/load")
    async def load() -> dict:
        return {"server_load": app.state.server_load_metrics}

    if tokenizer is not None:
        @app.get("/tokenizer_info")
        def tokenizer_info() -> dict:
            return tokenizer_settings(tokenizer)


def tokenizer_settings(tokenizer) -> dict:
    """What vLLM's /tokenizer_info answers: the tokenizer's init settings
    (file paths left out), its class, the chat template."""
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    config.pop("vocab_file", None)
    config.pop("merges_file", None)
    config = json.loads(json.dumps(config, default=str))  # AddedToken and the like: text
    config["tokenizer_class"] = type(tokenizer).__name__
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    return config
