"""The OpenAI wire format, and the error envelope every chapter shares (ch01).

- pydantic models for `/v1/chat/completions` (ch01) and `/v1/completions`,
  streaming chunks and logprobs (ch06), shaped so that the official `openai`
  client parses them with strict validation;
- validation as strict as OpenAI's: `"max_tokens": "8"` or `true` is a 400,
  not 8 or 1; a seed must fit in 64 bits; text must be valid Unicode (a lone
  UTF-16 surrogate such as "\\ud800" is refused here, before a tokenizer
  fails on it); `stream_options` needs `"stream": true`; a stop string may
  not be empty; OpenAI fields this server does not implement (tools,
  `echo`, `suffix`, `best_of`, audio...) are refused by name, never
  silently ignored. Unknown fields are ignored, as OpenAI and vLLM do;
- errors in OpenAI's envelope `{"error": {"message", "type", "param",
  "code"}}` with the right status: FastAPI's 422 becomes a 400 naming the
  `param`, an unexpected exception a 500 that keeps the connection open,
  a body over 1 MiB a 413 (`new_app` installs all of it, and fixes the
  OpenAPI schema to say so).

What needs the model (token ids inside the vocabulary, the context length)
is checked by the serving code, which knows the tokenizer.

Left out: tools/function calling, structured output, audio and images,
the Responses API.
"""
from __future__ import annotations

import logging
import uuid
from typing import Annotated, Literal, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException

from common import __version__

log = logging.getLogger("llm-course")

INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1  # a seed is a 64-bit integer (torch.Generator)
MAX_BODY_BYTES = 1 << 20  # 1 MiB: a full 8192-token prompt is ~40 KB of JSON


def unsupported(message: str) -> PydanticCustomError:
    """A 400 for a field OpenAI has and this server does not implement."""
    return PydanticCustomError("unsupported", message)


# ----------------------------------------------------------------- text
def valid_unicode(text: str) -> str:
    """JSON may carry a lone UTF-16 surrogate ("\\ud800"): not text, and no
    tokenizer can encode it. Refuse it here, with the field's name."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            "invalid_unicode", "contains {char} at position {position}: a lone UTF-16 "
            "surrogate is not valid Unicode text",
            {"char": repr(text[exc.start]), "position": exc.start}) from None
    return text


Text = Annotated[str, AfterValidator(valid_unicode)]


# ---------------------------------------------------------------- requests
class StrictModel(BaseModel):
    """Strict types as OpenAI's (no "8" for 8, no true for 1, no NaN or
    infinity for a number); unknown fields ignored."""
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class TextPart(StrictModel):
    type: Literal["text"] = "text"
    text: Text


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[Text, Annotated[list[TextPart], Field(min_length=1)]]  # required, as OpenAI

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_dict(self) -> dict:
        """{"role", "content"}: what a chat template takes."""
        return {"role": self.role, "content": self.text()}


# vLLM's request extras that this server does not implement: refused with a
# 400 that names them (when set to anything but their default), never ignored.
REFUSED_VLLM_FIELDS = {
    "prompt_logprobs": "prompt_logprobs (the prompt's own logprobs) is not supported.",
    "use_beam_search": "Beam search is not supported.",
    "structured_outputs": "Structured outputs (choice, regex, grammar, JSON schema) are "
                          "not supported yet.",
    "echo": "echo (the prompt repeated before the answer) is not supported.",
    "add_generation_prompt": "add_generation_prompt false is not supported: the chat "
                             "template always opens the assistant's turn.",
    "continue_final_message": "continue_final_message is not supported.",
    "continuous_usage_stats": "stream_options.continuous_usage_stats (usage in every chunk) "
                              "is not supported; include_usage sends it once, at the end.",
}


def refuse_unless_default(model: type[BaseModel], value, info: ValidationInfo):
    """A field of REFUSED_VLLM_FIELDS: the model's default for it passes,
    anything else is a 400 naming it."""
    if value != model.model_fields[info.field_name].default:
        raise unsupported(REFUSED_VLLM_FIELDS[info.field_name])
    return value


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: refused (REFUSED_VLLM_FIELDS)

    @field_validator("continuous_usage_stats")
    @classmethod
    def _refused(cls, value, info: ValidationInfo):
        return refuse_unless_default(cls, value, info)


class SamplingFields(StrictModel):
    """Fields shared by chat and text completions."""
    model: Text | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stop: Union[Text, list[Text], None] = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: Text | None = None
    # vLLM's extras
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    return_token_ids: bool = False  # the prompt's and the answer's token ids, beside the text
    prompt_logprobs: int | None = None  # refused (REFUSED_VLLM_FIELDS)
    use_beam_search: bool = False  # refused
    structured_outputs: dict | None = None  # refused

    @field_validator("prompt_logprobs", "use_beam_search", "structured_outputs")
    @classmethod
    def _refused_vllm_extras(cls, value, info: ValidationInfo):
        return refuse_unless_default(cls, value, info)

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise unsupported("stream_options is only allowed when stream is true.")
        return value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value):
        if value == "" or (isinstance(value, list) and "" in value):
            raise unsupported("A stop string may not be empty.")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value):
        for key in value or {}:
            # ASCII digits only: str.isdigit() also takes "²", which int() refuses,
            # and a few digits only: int() refuses 4,301 of them.
            if not (key.isascii() and key.isdigit() and len(key) <= 9):
                raise unsupported(f"logit_bias keys are token ids, got {key[:32]!r}.")
        return value

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}


# OpenAI chat fields that this server refuses rather than ignores, and why.
REFUSED_CHAT_FIELDS = {
    "tools": "Tool calling is not supported by this server.",
    "functions": "Tool calling is not supported by this server.",
    "tool_choice": "tool_choice needs tools, and tool calling is not supported.",
    "function_call": "function_call needs functions, and tool calling is not supported.",
    "audio": "Audio output is not supported.",
    "prediction": "Predicted outputs are not supported.",
    "web_search_options": "Web search is not supported.",
    "reasoning_effort": "reasoning_effort is for reasoning models; this one is not.",
}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict | None = None
    # OpenAI fields this server refuses rather than ignores:
    tools: list | None = None
    tool_choice: Union[str, dict, None] = None
    functions: list | None = None
    function_call: Union[str, dict, None] = None
    audio: dict | None = None
    modalities: list[str] | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None
    reasoning_effort: str | None = None
    # vLLM's chat extras this server refuses unless left at their defaults:
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("echo", "add_generation_prompt", "continue_final_message")
    @classmethod
    def _chat_template_extras(cls, value, info: ValidationInfo):
        return refuse_unless_default(cls, value, info)

    @field_validator(*REFUSED_CHAT_FIELDS)
    @classmethod
    def _refused(cls, value, info: ValidationInfo):
        if value not in (None, [], {}, "none"):  # "none": no tool call, as without tools
            raise unsupported(REFUSED_CHAT_FIELDS[info.field_name])
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value):
        if value and value.get("type", "text") != "text":
            raise unsupported('Only response_format {"type": "text"} is supported '
                              "(no JSON mode, no structured output).")
        return value

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, value):
        if value is not None and value != ["text"]:
            raise unsupported('Only modalities ["text"] is supported.')
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value, info: ValidationInfo):
        if value and not info.data.get("logprobs"):
            raise unsupported("top_logprobs requires logprobs to be true.")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def message_dicts(self) -> list[dict]:
        return [m.as_dict() for m in self.messages]

    def logprobs_count(self) -> int | None:
        """Top logprobs per token, or None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None


# ch06: `prompt` is a string, several strings, token ids, or several lists of ids.
PromptInput = Union[Text, list[Text], list[Annotated[int, Field(ge=0)]],
                    list[list[Annotated[int, Field(ge=0)]]]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = Field(default=None, ge=1)
    echo: bool = False
    suffix: Text | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value, info: ValidationInfo):
        if value is not None and value != info.data.get("n", 1):
            raise unsupported("best_of is not supported (only best_of = n).")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value):
        if value:
            raise unsupported("echo is not supported.")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise unsupported("suffix (insertion) is not supported.")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        return self.logprobs


# --------------------------------------------------------------- responses
# OpenAI's (and vLLM's) name for the build that answered: which server, which version.
SYSTEM_FINGERPRINT = f"llm-course-{__version__}"


def asked_only():
    """A field of vLLM's `return_token_ids`: on the wire only when asked for
    (vLLM sends it as null otherwise; OpenAI has no such field)."""
    return Field(default=None, exclude_if=lambda value: value is None)


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
    token_ids: list[int] | None = asked_only()  # vLLM's, with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str = SYSTEM_FINGERPRINT
    prompt_token_ids: list[int] | None = asked_only()  # vLLM's, with return_token_ids


# ch06: streaming chunks and text completions.
class ChunkChoice(BaseModel):
    index: int
    delta: dict[str, str]  # {"role": "assistant", "content": ""}, {"content": "..."} or {}
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    token_ids: list[int] | None = asked_only()  # this chunk's, with return_token_ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str = SYSTEM_FINGERPRINT
    prompt_token_ids: list[int] | None = asked_only()  # in the first chunk, with return_token_ids


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
    token_ids: list[int] | None = asked_only()  # vLLM's, with return_token_ids (a chunk's in a stream)
    prompt_token_ids: list[int] | None = asked_only()  # (a stream: in each choice's first chunk)


class CompletionResponse(BaseModel):
    """Also the shape of each streamed chunk of `/v1/completions`."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str = SYSTEM_FINGERPRINT


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
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope (also documented in the OpenAPI schema)."""
    error: ErrorInfo


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
