"""What the server answers: OpenAI's response models (ch01), chunks and logprobs (ch06).

Shaped so that the official `openai` client parses them with strict
validation: whole answers, streamed chunks (`ChatCompletionChunk`; a text
completion's chunk is a `CompletionResponse`), logprobs in the chat and
the text-completion shapes, usage, the model list, and OpenAI's error
envelope `{"error": {"message", "type", "param", "code"}}` (sent by
common/entrypoints/middleware.py). vLLM's `return_token_ids` fields appear
on the wire only when asked for; its `prompt_logprobs` is in every whole
answer, null unless asked for, and never in a chunk, as vLLM sends it. A
chunk carries `usage` only when it has one (vLLM's shape).

Left out: tool calls, refusals and audio in a message, the completion's
usage details (reasoning tokens), the Responses API.
"""
from __future__ import annotations

import json
import uuid
from typing import Callable, Literal, Union

from pydantic import BaseModel, Field

from common import __version__
from common.layers.sampler import SampledToken

# OpenAI's (and vLLM's) name for the build that answered: which server, which version.
SYSTEM_FINGERPRINT = f"llm-course-{__version__}"


def asked_only():
    """A field of vLLM's `return_token_ids`: on the wire only when asked for
    (vLLM sends it as null otherwise; OpenAI has no such field)."""
    return Field(default=None, exclude_if=lambda value: value is None)


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens the prefix cache held (ch04's blocks)
    # vLLM's: prompt tokens this request added to the cache (not in a completion's stream)
    created_cache_tokens: int | None = Field(default=None, exclude_if=lambda value: value is None)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # vLLM's --enable-prompt-tokens-details (ch06); OpenAI's field
    prompt_tokens_details: PromptTokensDetails | None = Field(
        default=None, exclude_if=lambda value: value is None)


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


class PromptLogprob(BaseModel):
    """vLLM's `Logprob`: one token's entry in a prompt position's logprobs."""
    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token {token id: its entry}, the first null
PromptLogprobs = list[dict[int, PromptLogprob] | None]


def prompt_logprobs(tokens: list[SampledToken | None] | None,
                    token_text: Callable[[int], str]) -> PromptLogprobs | None:
    """The engine's prompt logprobs in vLLM's shape: each position's own
    token first, then its top ones (ranked 1, 2, ...); -inf as -9999.0."""
    if tokens is None:
        return None

    def position(token: SampledToken) -> dict[int, PromptLogprob]:
        entries = [(token.token_id, token.logprob, token.rank)]  # (id, logprob, rank)
        entries += [(i, lp, rank) for rank, (i, lp) in enumerate(token.top_logprobs, start=1)]
        return {i: PromptLogprob(logprob=max(lp, -9999.0), rank=rank, decoded_token=token_text(i))
                for i, lp, rank in entries}

    return [None if token is None else position(token) for token in tokens]


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
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's: null unless asked (ch06)


def only_when_set():
    """A chunk's `usage`: on the wire only in the chunks that carry one."""
    return Field(default=None, exclude_if=lambda value: value is None)


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
    usage: Usage | None = only_when_set()
    system_fingerprint: str = SYSTEM_FINGERPRINT
    prompt_token_ids: list[int] | None = asked_only()  # in the first chunk, with return_token_ids


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChunkChoice(BaseModel):
    """A text completion's choice in a streamed chunk."""
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    token_ids: list[int] | None = asked_only()  # vLLM's, with return_token_ids (a chunk's in a stream)
    prompt_token_ids: list[int] | None = asked_only()  # (a stream: in each choice's first chunk)


class CompletionChoice(CompletionChunkChoice):
    """A text completion's choice in a whole answer."""
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's: null unless asked (never streamed)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str = SYSTEM_FINGERPRINT


class CompletionChunk(CompletionResponse):
    """A streamed chunk of `/v1/completions`: the answer's fields, in the
    same order (OpenAI gives it the answer's object), with a chunk's choices
    and a usage only in the chunk that has one."""
    choices: list[CompletionChunkChoice]
    usage: Usage | None = only_when_set()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llm-course"
    max_model_len: int | None = None
    root: str | None = None  # ch10: where the weights come from (an adapter's folder)
    parent: str | None = None  # ch10: an adapter's base model


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
