"""Chapter 01's app: chat completions around a `generate` function (ch01).

`build_chat_app(generate)` serves `/v1/models`, `/health` and
`POST /v1/chat/completions` with a plain `def` endpoint, which FastAPI
runs in a worker thread per request, around the chapter's own `generate`
(the autoregressive loop by hand). Chapter 02 writes the same endpoint out
around `model.generate`, top to bottom, in its own server.py.

It shares the HTTP edge of every chapter (common/entrypoints/middleware.py:
OpenAI's error envelope, 400 naming the `param`, the 1 MiB body limit) and
the checks of the engine's serving code (model name, context length).

Left out: the engine (chapter 03 on), streaming (chapter 06), and the
sampling fields `generate` does not honour: refused with a 400 naming the
chapter that adds them (common/entrypoints/chapters.py), never silently
ignored.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, Literal

from fastapi import FastAPI

from common import __version__
from common.context_length import default_max_tokens
from common.entrypoints.chapters import refuse_later_fields
from common.entrypoints.middleware import new_app
from common.entrypoints.protocol import ChatCompletionRequest
from common.entrypoints.responses import (
    ChatChoice,
    ChatCompletionResponse,
    ModelCard,
    ModelList,
    ResponseMessage,
    new_id,
)
from common.entrypoints.request_checks import check_context, check_model_name, usage
from common.loader import apply_chat_template


@dataclass
class Completion:
    """What chapter 01's `generate` returns for one prompt."""
    token_ids: list[int]
    finish_reason: Literal["stop", "length"]


GenerateFn = Callable[[list[int], ChatCompletionRequest, int, "int | None"], Completion]

def build_chat_app(title: str, model_name: str, max_model_len: int, tokenizer,
                   generate: GenerateFn, serialize: bool = False,
                   chapter: str = "01") -> FastAPI:
    """FastAPI app with `/v1/models`, `/health` and `/v1/chat/completions`.

    `generate(prompt_ids, request, max_tokens, seed)` is the chapter's
    model. `serialize=True` puts a lock around `generate` (chapter 01 runs
    one request at a time). The fields of later chapters (`top_p`, `stop`,
    `stream`, ...) are a 400 naming the chapter that adds them.
    """
    app = new_app(title, __version__)
    created = int(time.time())
    lock = threading.Lock() if serialize else contextlib.nullcontext()

    @app.get("/v1/models", response_model_exclude_none=True)  # root, parent: ch10's
    def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, created=created,
                                         max_model_len=max_model_len)])

    @app.get("/health")
    async def health() -> dict:  # on the event loop: no worker thread needed
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    def chat(req: ChatCompletionRequest) -> ChatCompletionResponse:
        # A plain `def`: FastAPI runs it in a worker thread, per request.
        check_model_name(req.model, model_name)
        refuse_later_fields(req, chapter)
        prompt_ids = apply_chat_template(tokenizer, req.message_dicts())
        max_tokens = req.requested_max_tokens() or default_max_tokens(len(prompt_ids),
                                                                      max_model_len)
        check_context(len(prompt_ids), max_tokens, max_model_len, "messages")
        seeds = [None if req.seed is None else req.seed + k for k in range(req.n)]
        with lock:
            completions = [generate(prompt_ids, req, max_tokens, seed) for seed in seeds]
        choices = [ChatChoice(index=i, finish_reason=c.finish_reason,
                              message=ResponseMessage(content=tokenizer.decode(
                                  c.token_ids, skip_special_tokens=True)))
                   for i, c in enumerate(completions)]
        return ChatCompletionResponse(
            id=new_id("chatcmpl"), created=int(time.time()), model=model_name,
            choices=choices,
            usage=usage([prompt_ids], sum(len(c.token_ids) for c in completions)))

    return app
