"""The OpenAI wire format and the FastAPI pieces every chapter shares (ch01).

- pydantic models for `/v1/chat/completions` and `/v1/models`, shaped so
  that the official `openai` client parses them with strict validation;
- errors in OpenAI's envelope `{"error": {"message", "type", "param",
  "code"}}`, including FastAPI's validation errors (422 -> 400);
- `build_chat_app`: the chat endpoint around a chapter's `generate`;
- ch06: the text-completion request, streaming chunks and logprobs shapes
  (`common/entrypoints/api_server.py` serves them).

Left out: tools/function calling, response_format, audio and images,
`best_of`, `echo`, `suffix`, `logit_bias` (accepted and ignored, like any
unknown field).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable, Literal, Union

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("llm-course")

DEFAULT_MAX_TOKENS = 256  # chapters 01-05; chapter 06 fills max_model_len
DISCONNECT_POLL_S = 0.25


# ---------------------------------------------------------------- requests
class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[TextPart]] = ""

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_dict(self) -> dict:
        """{"role", "content"}: what a chat template takes."""
        return {"role": self.role, "content": self.text()}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions. Unknown fields are ignored."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM's extras
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict] | None = None  # ch06: refused with a clear 400, not ignored
    response_format: dict | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def message_dicts(self) -> list[dict]:
        return [m.as_dict() for m in self.messages]


# ch06: `prompt` is a string, several strings, token ids, or several lists of ids.
PromptInput = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    logprobs: int | None = Field(default=None, ge=0, le=20)


# --------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    finish_reason: Literal["stop", "length"]
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


# ch06: streaming chunks and text completions.
class ChunkChoice(BaseModel):
    index: int
    delta: dict[str, str]  # {"role": "assistant", "content": ""}, {"content": "..."} or {}
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    """Also the shape of each streamed chunk of `/v1/completions`."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llm-course"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ------------------------------------------------------------------ errors
class APIError(Exception):
    """An error that goes back to the client in OpenAI's envelope."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code


def error_response(status: int, message: str, type: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return "We could not parse the JSON body of your request. " \
               f"({first.get('msg')})", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    return f"Invalid value for '{param}': {first.get('msg')}", param


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's envelope; the server stays up."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("error while serving %s", request.url.path)
        return error_response(500, f"{type(exc).__name__}: {exc}", "internal_server_error")


# ------------------------------------------------------- the chat endpoint
@dataclass
class Completion:
    """What a chapter's generate function returns for one prompt."""
    token_ids: list[int]
    finish_reason: Literal["stop", "length"]


async def cancel_on_disconnect(request: Request, work: Awaitable):
    """Await `work`, but cancel it (aborting its engine requests) if the
    client hangs up first: a dropped non-streaming request frees its blocks."""
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


GenerateFn = Callable[[list[int], ChatCompletionRequest, int],
                      Union[Completion, Awaitable[Completion]]]


def check_model_name(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(404, f"The model `{requested}` does not exist.",
                       "not_found_error", "model", "model_not_found")


def check_context_length(prompt_len: int, max_tokens: int, max_model_len: int,
                         param: str = "messages") -> None:
    if prompt_len + max_tokens > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} "
                       f"tokens. However, you requested {prompt_len + max_tokens} tokens "
                       f"({prompt_len} in the {param}, {max_tokens} in the completion). "
                       f"Please reduce the length of the {param} or completion.",
                       param=param, code="context_length_exceeded")


def build_chat_app(title: str, model_name: str, max_model_len: int, tokenizer,
                   generate: GenerateFn, apply_template: Callable[[list[dict]], list[int]],
                   serialize: bool = False) -> FastAPI:
    """FastAPI app with `/v1/models` and `/v1/chat/completions`.

    `generate(prompt_ids, request, max_tokens)` is the chapter's engine. A
    plain function runs in FastAPI's thread pool, one thread per request
    (chapter 02's design); `serialize=True` puts a lock around it (chapter
    01 runs one request at a time). An `async def` runs on the event loop.
    """
    app = FastAPI(title=title)
    install_error_handlers(app)
    created = int(time.time())
    lock = threading.Lock()

    @app.get("/v1/models")
    def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, created=created,
                                         max_model_len=max_model_len)])

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    def prepare(req: ChatCompletionRequest) -> tuple[list[int], int]:
        check_model_name(req.model, model_name)
        prompt_ids = apply_template(req.message_dicts())
        max_tokens = req.requested_max_tokens() or min(
            DEFAULT_MAX_TOKENS, max_model_len - len(prompt_ids))
        check_context_length(len(prompt_ids), max_tokens, max_model_len)
        return prompt_ids, max_tokens

    def respond(prompt_ids: list[int], completions: list[Completion]) -> ChatCompletionResponse:
        choices = [ChatChoice(index=i, finish_reason=c.finish_reason,
                              message=ResponseMessage(content=tokenizer.decode(
                                  c.token_ids, skip_special_tokens=True)))
                   for i, c in enumerate(completions)]
        generated = sum(len(c.token_ids) for c in completions)
        return ChatCompletionResponse(
            id=new_id("chatcmpl"), created=int(time.time()), model=model_name,
            choices=choices, usage=Usage(prompt_tokens=len(prompt_ids),
                                         completion_tokens=generated,
                                         total_tokens=len(prompt_ids) + generated))

    if inspect.iscoroutinefunction(generate):
        @app.post("/v1/chat/completions")
        async def chat_async(req: ChatCompletionRequest, request: Request
                             ) -> ChatCompletionResponse:
            prompt_ids, max_tokens = prepare(req)
            completions = await cancel_on_disconnect(request, asyncio.gather(
                *[generate(prompt_ids, req, max_tokens) for _ in range(req.n)]))
            return respond(prompt_ids, list(completions))
    else:
        @app.post("/v1/chat/completions")
        def chat_threaded(req: ChatCompletionRequest) -> ChatCompletionResponse:
            # A plain `def`: FastAPI runs it in a worker thread per request.
            prompt_ids, max_tokens = prepare(req)
            with lock if serialize else contextlib.nullcontext():
                completions = [generate(prompt_ids, req, max_tokens) for _ in range(req.n)]
            return respond(prompt_ids, completions)

    return app


# ------------------------------------------------------- command line
def server_parser(description: str) -> argparse.ArgumentParser:
    from common.config import add_engine_args
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0 exposes it to the network)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    add_engine_args(parser)
    return parser


def run_server(app: FastAPI, host: str, port: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    uvicorn.run(app, host=host, port=port, log_level="info")
