"""The chat server on the engine (ch03-05): the chat answered whole, models, health, stats.

Routes only: the chat route hands its validated request to
`OpenAIServingChat` (serving_chat.py, on serving_engine.py, the only code
that talks to the engine). `stream: true` and every other field of a later
chapter is a 400 that names the chapter (chapters.py). `--live-view` adds
the live view at /ui/ (live_view.py).

Chapter 06's OpenAI server (api_server.py) adds its routes to the same
`add_engine_routes`.

Left out: streaming, text completions, /metrics (chapter 06).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from typing import Callable

from fastapi import FastAPI, Request

from common import __version__
from common.config import ConfigError, EngineConfig, config_from_args
from common.engine.async_llm import AsyncLLM, EngineClient, EngineDeadError
from common.engine.parts import EngineParts, assemble_engine
from common.entrypoints.chapters import refuse_later_fields
from common.entrypoints.cli_args import (EngineCoreMode, parse_server_args,
                                         server_parser)
from common.entrypoints.launcher import serve
from common.entrypoints.live_view import watch_engine
from common.entrypoints.middleware import RateLimit, new_app
from common.entrypoints.protocol import ChatCompletionRequest
from common.entrypoints.responses import ModelCard, ModelList
from common.entrypoints.serving_chat import OpenAIServingChat
from common.entrypoints.serving_engine import engine_error

log = logging.getLogger("llm-course")

MONITORING_PER_S = 20  # answers a second on /stats and /metrics, all clients together


def add_engine_routes(app: FastAPI, engine: EngineClient, model_name: str,
                      models=None) -> None:
    """The routes of chapters 03-06 around the chat: models, health, stats.
    `/stats` (and chapter 06's `/metrics`) share `app.state.monitoring`.
    `models` (ch10): an OpenAIServingModels, which lists the adapters too."""
    created = int(time.time())
    app.state.monitoring = RateLimit(MONITORING_PER_S)

    if models is not None:  # ch10: the base model and its adapters, as vLLM lists them
        app.get("/v1/models")(lambda: models.show_available_models(engine.max_model_len))
    else:
        @app.get("/v1/models", response_model_exclude_none=True)  # root, parent: ch10's
        def show_available_models() -> ModelList:
            return ModelList(data=[ModelCard(id=model_name, created=created,
                                             max_model_len=engine.max_model_len)])

    @app.get("/health")
    async def health() -> dict:  # on the event loop: no worker thread needed
        return engine_health(engine)

    @app.get("/stats")
    async def stats() -> dict:  # the figures published after the last step: no lock
        await app.state.monitoring.wait()
        return engine.snapshot()


def engine_health(engine: EngineClient) -> dict:
    """/health's answer: ok, or 503 `engine_dead`."""
    if not engine.alive:
        raise engine_error(EngineDeadError(f"the engine loop has died: {engine.dead!r}"))
    return {"status": "ok"}


def add_live_view_if_asked(app: FastAPI, engine: EngineClient, chapter: str,
                           args) -> None:
    """`--live-view`: the page at /ui/, and its URL in the log."""
    if not args.live_view:
        return
    watch_engine(app, engine, chapter)
    key = "?key=YOUR_API_KEY" if getattr(args, "api_key", None) else ""
    log.info("live view: open http://%s:%d/ui/%s in a browser", args.host, args.port, key)


def build_engine(parser: argparse.ArgumentParser, config: EngineConfig,
                 engine_parts: Callable[[EngineConfig], EngineParts],
                 args: argparse.Namespace) -> EngineClient:
    """The chapter's engine (its parts: `engine_parts(config)`) where the
    flags put it: `AsyncLLM` on a thread of this process (ch03-08, and
    ch09's `--engine-core in-process`), or `AsyncMPClient` with
    `--data-parallel-size` processes (ch09, imported only then: ZeroMQ and
    msgpack are chapter 09's). Flags that do not fit the model
    (`--tensor-parallel-size 2` for 9 heads, ch08) exit as a usage error."""
    try:
        parts = engine_parts(config)
        if getattr(args, "engine_core", EngineCoreMode.IN_PROCESS) is EngineCoreMode.PROCESS:
            from common.engine.core import EngineCoreSpec  # ch09
            from common.engine.core_client import AsyncMPClient
            return AsyncMPClient.start(EngineCoreSpec(config, parts, watched=args.live_view),
                                       args.data_parallel_size)
        return AsyncLLM.build(lambda: assemble_engine(config, parts))
    except ConfigError as exc:
        parser.error(str(exc))


# ----------------------------------------------------- chapters 03-05
def build_engine_chat_app(title: str, engine: EngineClient, model_name: str,
                          chapter: str) -> FastAPI:
    """Chat completions answered whole, on the engine (ch03-05)."""
    chat = OpenAIServingChat(engine, model_name)
    app = new_app(title, __version__)
    add_engine_routes(app, engine, model_name)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, request: Request):
        refuse_later_fields(req, chapter)  # `stream` is chapter 06's, grammars 07's
        return await chat.create_chat_completion(req, request)

    return app


def run_chat_server(chapter: str, title: str,
                    engine_parts: Callable[[EngineConfig], EngineParts],
                    **config: object) -> int:
    """Chapters 03-05's main: parse the chapter's flags, build the engine
    from the chapter's parts and `config` (EngineConfig fields the chapter
    sets), serve."""
    parser = server_parser(title, chapter)
    args = parse_server_args(parser, chapter)
    engine_config = dataclasses.replace(config_from_args(args), **config)
    engine = build_engine(parser, engine_config, engine_parts, args)
    app = build_engine_chat_app(title, engine, engine_config.model_name, chapter)
    add_live_view_if_asked(app, engine, chapter, args)
    return serve(app, args, engine)
