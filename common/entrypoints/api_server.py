"""The OpenAI-compatible server on the engine (ch06; chapters 07-09 run it too).

Routes only. Each route hands its validated request to a serving class
that does the work, one endpoint per file: serving_chat.py,
serving_completion.py, serving_tokenization.py, on the core in
serving_engine.py (the only code that talks to the engine).

- chapters 03-05's routes are chat_server.py's: `/v1/models`, `/health`,
  `/stats` and chat completions answered whole;
- chapter 06, `build_app` and `main`: what an existing OpenAI app needs to
  work by changing only `base_url`: the same routes, streaming (SSE), text
  completions, `/tokenize`, `/detokenize`, `/version`, `/metrics`
  (Prometheus, vLLM's names), `--api-key` (401), `--max-waiting`
  backpressure (503 with `Retry-After`), `--disable-fastapi-docs`;
- chapters 07, 08 and 09 run the same `main` with their own engine parts
  (each server.py's `engine_parts`: chapter 07's grammar step and drafts)
  and their own flags (the table of which chapter adds which flag and
  field: common/entrypoints/chapters.py); chapter 09's engine runs in
  processes of its own (cli_args.py's `build_engine`).

`--live-view` adds the live view at /ui/ (live_view.py) to any of them.

Every server shares the HTTP edge (middleware.py), the command line
(cli_args.py), a read deadline and a bounded graceful shutdown
(launcher.py), and, if the engine loop dies, 503 `engine_dead` then exit
code 1, so that a supervisor restarts the server (what vLLM does).

Left out: tool calls, the Responses API, embeddings,
several models per server, and byte-exact token strings in logprobs (a
token that holds part of a UTF-8 character shows as "\\ufffd").
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import transformers
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from common import __version__
from common.config import EngineConfig, config_from_args
from common.engine.async_llm import EngineClient
from common.engine.parts import EngineParts
from common.entrypoints.chapters import refuse_later_fields
from common.entrypoints.chat_server import (add_engine_routes, add_live_view_if_asked,
                                            build_engine, engine_health)
from common.entrypoints.cli_args import DEFAULT_MAX_WAITING, api_server_parser, parse_server_args
from common.entrypoints.launcher import serve
from common.entrypoints.metrics import Metrics
from common.entrypoints.middleware import APIKeyCheck, new_app
from common.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from common.entrypoints.serving_chat import OpenAIServingChat
from common.entrypoints.serving_completion import OpenAIServingCompletion
from common.entrypoints.serving_engine import MAX_LOGPROBS
from common.entrypoints.serving_tokenization import OpenAIServingTokenization
from common.entrypoints.vllm_routes import add_vllm_routes

log = logging.getLogger("llm-course")

def build_app(engine: EngineClient, model_name: str, api_key: str | None = None,
              max_waiting: int = DEFAULT_MAX_WAITING, disable_docs: bool = False,
              metrics: Metrics | None = None, chapter: str = "06",
              title: str = "Chapter 06: the OpenAI-compatible server",
              load_tracking: bool = False, tokenizer_info: bool = False,
              max_logprobs: int = MAX_LOGPROBS, prompt_tokens_details: bool = False,
              models=None) -> FastAPI:
    """The OpenAI-compatible app: chapter 05's routes, streaming, and the rest.
    `chapter`: the fields of later chapters are refused (chapter 06 has no grammars).
    `load_tracking`, `tokenizer_info`, `max_logprobs`, `prompt_tokens_details`:
    vLLM's flags for /load, /tokenizer_info, the logprobs' cap and the usage's
    cached tokens. `models` (ch10): the adapters served beside the model
    (an OpenAIServingModels, serving_models.py), None: the model alone."""
    metrics = metrics or Metrics(engine.snapshot, model_name, lambda: engine.alive,
                                 max_model_len=engine.max_model_len,
                                 cache_config=engine.cache_config_info)
    engine.add_stat_logger(metrics)  # the engine times every token, streamed or not
    core = dict(default_max_tokens=None,  # vLLM: a missing max_tokens fills the context
                max_waiting=max_waiting, metrics=metrics, max_logprobs=max_logprobs,
                prompt_tokens_details=prompt_tokens_details, models=models)
    chat = OpenAIServingChat(engine, model_name, **core)
    completion = OpenAIServingCompletion(engine, model_name, **core)
    tokenization = OpenAIServingTokenization(engine, model_name, models=models)
    app = new_app(title, __version__, disable_docs)
    if api_key:
        app.add_middleware(APIKeyCheck, api_key=api_key)
    add_engine_routes(app, engine, model_name, models)
    if models is not None:  # ch10: load and unload adapters, where allowed
        models.add_routes(app)
        models.add_metrics(metrics, engine.snapshot)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, request: Request):
        refuse_later_fields(req, chapter)
        return await chat.create_chat_completion(req, request)

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, request: Request):
        refuse_later_fields(req, chapter)
        return await completion.create_completion(req, request)

    @app.get("/version")
    def version() -> dict:
        return {"version": __version__, "torch": torch.__version__,
                "transformers": transformers.__version__}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def show_metrics() -> Response:  # reads the last step's snapshot: no lock
        await app.state.monitoring.wait()
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    app.post("/tokenize")(tokenization.tokenize)
    app.post("/detokenize")(tokenization.detokenize)
    add_vllm_routes(app, {ChatCompletionRequest: create_chat_completion,  # /invocations'
                          CompletionRequest: create_completion},  # order, as vLLM's
                    lambda: engine_health(engine), load_tracking,
                    engine.tokenizer if tokenizer_info else None)
    return app


def main(chapter: str, title: str,
         engine_parts: Callable[[EngineConfig], EngineParts],
         serving_models: Callable[[EngineConfig], object] | None = None) -> int:
    """Chapters 06-10's main, like `vllm serve`: the chapter's flags, its
    engine built from `engine_parts(config)` (its server.py's), the app.
    `serving_models(config)` (ch10): the adapters it serves, or None."""
    parser = api_server_parser(title, chapter)
    args = parse_server_args(parser, chapter)
    config = config_from_args(args)
    try:  # ch10: the adapters are read first: a bad folder stops the server at once
        models = serving_models(config) if serving_models else None
    except ValueError as exc:
        parser.error(str(exc))
    engine = build_engine(parser, config, engine_parts, args)
    app = build_app(engine, config.model_name, args.api_key, args.max_waiting,
                    args.disable_fastapi_docs, chapter=chapter, title=title,
                    load_tracking=args.enable_server_load_tracking,
                    tokenizer_info=args.enable_tokenizer_info_endpoint,
                    max_logprobs=args.max_logprobs,
                    prompt_tokens_details=args.enable_prompt_tokens_details,
                    models=models)
    add_live_view_if_asked(app, engine, chapter, args)
    log.info("serving %s on http://%s:%d/v1", config.model_name, args.host, args.port)
    return serve(app, args, engine)

