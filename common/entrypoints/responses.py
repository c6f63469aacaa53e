"""What the server answers: OpenAI's response models (ch01), chunks and logprobs (ch06).

Shaped so that the official `openai` client parses them with strict
validation: whole answers, streamed chunks (`ChatCompletionChunk`; a text
completion's chunk is a `CompletionResponse`), logprobs in the chat and
the text-completion shapes, usage, the model list, and OpenAI's error
envelope `{"error": {"message", "type", "param", "code"}}` (sent by
common/entrypoints/middleware.py). vLLM's `return_token_ids` fields appear
on the wire only when asked for.

Left out: tool calls, refusals and audio in a message, usage details
(cached and reasoning tokens), the Responses API.
"""
from __future__ import annotations

import json
import uuid
from typing import Literal, Union

from pydantic import BaseModel, Field

from common import __version__

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


def sse(payload: Union[BaseModel, dict, str]) -> str:
    """One Server-Sent Event: `data: ...` and a blank line (ch06)."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json()
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"
