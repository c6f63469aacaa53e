"""The OpenAI-compatible server on the continuous-batching engine (ch06).

What an existing OpenAI app needs to work by changing only `base_url`:

- `POST /v1/chat/completions` and `POST /v1/completions`, whole answers
  or Server-Sent Events (`stream: true`), `n` choices, stop strings,
  seeds, penalties, logprobs, vLLM's extra sampling fields;
- `GET /v1/models`, `GET /health` (503 once the engine loop is dead),
  `GET /version`, `GET /metrics` (Prometheus, vLLM's names),
  `POST /tokenize`, `POST /detokenize`, and `GET /stats` (chapters 03-05);
- errors in OpenAI's envelope: 400 bad input, 401 wrong API key, 404
  unknown model, 413 body too large, 503 queue full or engine dead, 500
  internal errors (the engine keeps serving);
- a client that goes away (stream closed, request dropped) has its request
  aborted, and its KV blocks freed, at the next engine step.

A request's way: pydantic validation -> chat template -> token ids -> one
engine request per choice (`AsyncLLMEngine.generate`) -> the choices'
outputs merged as they come -> one JSON answer, or SSE chunks.

Left out: tool calls, structured output, the Responses API, embeddings,
several models per server, and byte-exact token strings in logprobs (a
token that holds part of a UTF-8 character shows as "\\ufffd").
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import AsyncIterator, Union

import torch
import transformers
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from common import __version__
from common.config import config_from_args
from common.engine.llm_engine import AsyncLLMEngine, LLMEngine, RequestOutput, RequestStream
from common.entrypoints.chat_server import sampling_params_from_request
from common.loader import apply_chat_template
from common.entrypoints.metrics import Metrics, RequestTracker
from common.entrypoints.protocol import (APIError, ChatChoice, ChatCompletionChunk,
                               ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
                               ChatMessage, ChunkChoice, CompletionChoice,
                               CompletionLogprobs, CompletionRequest, CompletionResponse,
                               ModelCard, ModelList, ResponseMessage, SamplingFields,
                               TokenLogprob, TopLogprob, Usage, cancel_on_disconnect,
                               check_context_length,
                               check_model_name, error_response, install_error_handlers,
                               new_id, run_server, server_parser)
from common.layers.sampler import SampledToken
from common.sampling_params import SamplingParams

log = logging.getLogger("llm-course")

MAX_BODY_BYTES = 1 << 20  # 1 MiB: a full 8192-token prompt is ~40 KB of JSON
DEFAULT_MAX_WAITING = 256


# ------------------------------------------------------ small request models
class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a prompt, or chat messages through the template."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------- ASGI middleware
class BodySizeLimit:
    """413 for a body over `max_bytes`, counted as it arrives (a client may
    send no Content-Length). An oversized body is drained, not kept, so the
    client reads our answer instead of a reset connection."""

    def __init__(self, app, max_bytes: int):
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
            response = error_response(413, f"Request body too large: {size} bytes; "
                                      f"the limit is {self.max_bytes} bytes.",
                                      "invalid_request_error", code="request_too_large")
            return await response(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # later calls: wait for the disconnect
            replayed = True
            return {"type": "http.request", "body": b"".join(body), "more_body": False}

        await self.app(scope, replay, send)


class APIKeyCheck:
    """`--api-key`: every `/v1/*` request needs `Authorization: Bearer KEY`."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response(401, "Incorrect API key provided.",
                                          "invalid_request_error", code="invalid_api_key")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


# ------------------------------------------------------ streams of choices
@dataclass
class Choice:
    """One of a response's n choices: an engine request and its latency tracker."""
    stream: RequestStream
    tracker: RequestTracker


def close_all(choices: list[Choice]) -> None:
    """Abort whatever has not finished (a no-op for finished choices)."""
    for choice in choices:
        choice.stream.close()


async def merge_choices(choices: list[Choice]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the choices' outputs as they come: (choice index, output).
    Closing this iterator aborts every unfinished choice."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, choice: Choice) -> None:
        try:
            async for output in choice.stream:
                choice.tracker.on_output(output)
                queue.put_nowait((index, output))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(choices)]
    remaining = len(choices)
    try:
        while remaining:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            remaining -= item.finished
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        close_all(choices)


@dataclass
class Delta:
    """What one choice added since its previous output, for a stream chunk."""
    index: int
    output: RequestOutput
    text: str  # new text (stop strings held back, never leaked)
    tokens: list[SampledToken]  # new tokens, with their logprobs when asked for
    text_offset: int  # characters of this choice already sent before `text`


async def merge_deltas(choices: list[Choice]) -> AsyncIterator[Delta]:
    """merge_choices, turned from "everything so far" into "what is new"."""
    sent_text = [0] * len(choices)  # characters already sent, per choice
    sent_tokens = [0] * len(choices)
    async with contextlib.aclosing(merge_choices(choices)) as merged:  # closed with us
        async for i, out in merged:
            yield Delta(i, out, out.text[sent_text[i]:], out.logprobs[sent_tokens[i]:],
                        sent_text[i])
            sent_text[i], sent_tokens[i] = len(out.text), len(out.logprobs)


def sse(payload: Union[BaseModel, dict, str]) -> str:
    """One Server-Sent Event: `data: ...` and a blank line."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json()
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


# ----------------------------------------------------------------- serving
class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs back
    into OpenAI responses. Only this class talks to the AsyncLLMEngine."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, max_waiting: int):
        self.engine = engine
        self.model_name = model_name
        self.max_waiting = max_waiting
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        block_manager = engine.engine.block_manager
        self.cache_tokens = block_manager.num_blocks * block_manager.block_size
        self.metrics = Metrics(engine.snapshot, model_name)

    # -------------------------------------------------------- validation
    def check_ready(self, num_new: int) -> None:
        if not self.engine.alive:
            raise APIError(503, "The engine is not running; see the server log.",
                           "server_error", code="engine_dead")
        waiting = self.engine.num_waiting()  # exact: add_request queues at once
        if waiting + num_new > self.max_waiting:  # backpressure, not unbounded memory
            raise APIError(503, f"The server is overloaded: {waiting} requests are "
                           f"waiting (--max-waiting {self.max_waiting}). Retry later.",
                           "server_error", code="server_overloaded")

    def sampling_params(self, req: SamplingFields, prompt_ids: list[int], sample: int,
                        logprobs: int | None, param: str) -> SamplingParams:
        """The engine's SamplingParams for one choice. max_tokens defaults to
        whatever fits in max_model_len; sample k of a seeded request gets
        seed + k, so the n choices differ yet replay the same."""
        max_tokens = req.max_tokens
        if isinstance(req, ChatCompletionRequest):
            max_tokens = req.requested_max_tokens()
        if max_tokens is None:  # what fits in the context, and in the whole cache
            max_tokens = max(1, min(self.max_model_len, self.cache_tokens) - len(prompt_ids))
        check_context_length(len(prompt_ids), max_tokens, self.max_model_len, param)
        try:
            params = sampling_params_from_request(req, max_tokens, sample, logprobs)
            self.engine.engine.check_request(prompt_ids, params)
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from None
        return params

    def start(self, request_id: str, prompts: list[list[int]], req: SamplingFields,
              logprobs: int | None, param: str) -> list[Choice]:
        """Validate everything first, then queue one engine request per
        choice: choice k is sample k % n of prompt k // n."""
        check_model_name(req.model, self.model_name)
        prepared = [(ids, self.sampling_params(req, ids, sample, logprobs, param))
                    for ids in prompts for sample in range(req.n)]
        self.check_ready(len(prepared))
        return [Choice(self.engine.add_request(f"{request_id}-{k}", ids, params),
                       self.metrics.tracker())
                for k, (ids, params) in enumerate(prepared)]

    # ------------------------------------------------------------ inputs
    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if req.tools:
            raise APIError(400, "Tool calling is not supported by this server.",
                           param="tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise APIError(400, "Only response_format {\"type\": \"text\"} is supported "
                           "(no JSON mode, no structured output).", param="response_format")
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true.",
                           param="top_logprobs")
        return apply_chat_template(self.tokenizer, req.message_dicts())

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]  # one prompt
        if not prompt or any(len(p) == 0 for p in prompt):
            raise APIError(400, "The prompt must not be empty.", param="prompt")
        return [self.encode(p) if isinstance(p, str) else self.checked_ids(p, "prompt")
                for p in prompt]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def checked_ids(self, ids: list[int], param: str) -> list[int]:
        vocab = len(self.tokenizer)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise APIError(400, f"Token id {bad[0]} is out of range [0, {vocab}).",
                           param=param)
        return ids

    # ------------------------------------------------------------ outputs
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat_logprobs(self, tokens: list[SampledToken]) -> ChatLogprobs:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return ChatLogprobs(content=[
            TokenLogprob(**entry(t.token_id, t.logprob),
                         top_logprobs=[TopLogprob(**entry(i, lp)) for i, lp in t.top_logprobs])
            for t in tokens])

    def completion_logprobs(self, tokens: list[SampledToken], offset: int) -> CompletionLogprobs:
        """`offset`: characters of this choice's text before these tokens."""
        texts = [self.token_text(t.token_id) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return CompletionLogprobs(
            tokens=texts, token_logprobs=[t.logprob for t in tokens],
            top_logprobs=[{self.token_text(i): lp for i, lp in t.top_logprobs} for t in tokens],
            text_offset=offsets)

    @staticmethod
    def usage(prompts: list[list[int]], completion_tokens: int) -> Usage:
        prompt_tokens = sum(len(p) for p in prompts)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)

    @staticmethod
    async def final_outputs(request: Request, choices: list[Choice]) -> list[RequestOutput]:
        """Each choice's last output, for a non-streaming answer."""
        async def collect() -> list[RequestOutput]:
            last: dict[int, RequestOutput] = {}
            async for index, output in merge_choices(choices):
                last[index] = output
            return [last[i] for i in range(len(choices))]

        try:
            return await cancel_on_disconnect(request, collect())
        finally:
            close_all(choices)

    # --------------------------------------------------------- chat
    async def chat(self, req: ChatCompletionRequest, request: Request):
        prompt = self.chat_prompt(req)
        request_id = new_id("chatcmpl")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        choices = self.start(request_id, [prompt], req, logprobs, "messages")
        if req.stream:
            return event_stream(self.chat_chunks(request_id, [prompt], req, choices), choices)
        outputs = await self.final_outputs(request, choices)
        choices = [ChatChoice(index=i, message=ResponseMessage(content=o.text),
                              finish_reason=o.finish_reason,
                              logprobs=self.chat_logprobs(o.logprobs) if req.logprobs else None)
                   for i, o in enumerate(outputs)]
        return ChatCompletionResponse(
            id=request_id, created=int(time.time()), model=self.model_name, choices=choices,
            usage=self.usage([prompt], sum(len(o.token_ids) for o in outputs)))

    async def chat_chunks(self, request_id: str, prompts: list[list[int]],
                          req: ChatCompletionRequest,
                          choices: list[Choice]) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created,
                                           model=self.model_name, choices=choices, usage=usage))

        for i in range(len(choices)):
            yield chunk([ChunkChoice(index=i, delta={"role": "assistant", "content": ""})])
        completion_tokens = 0
        async for d in merge_deltas(choices):
            new_logprobs = d.tokens if req.logprobs else []
            if d.text or new_logprobs:
                yield chunk([ChunkChoice(
                    index=d.index, delta={"content": d.text},
                    logprobs=self.chat_logprobs(new_logprobs) if req.logprobs else None)])
            if d.output.finished:
                completion_tokens += len(d.output.token_ids)
                yield chunk([ChunkChoice(index=d.index, delta={},
                                         finish_reason=d.output.finish_reason)])
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], self.usage(prompts, completion_tokens))

    # --------------------------------------------------- text completions
    async def completion(self, req: CompletionRequest, request: Request):
        prompts = self.completion_prompts(req)
        request_id = new_id("cmpl")
        choices = self.start(request_id, prompts, req, req.logprobs, "prompt")
        if req.stream:
            return event_stream(self.completion_chunks(request_id, prompts, req, choices),
                                choices)
        outputs = await self.final_outputs(request, choices)
        choices = [CompletionChoice(
            index=i, text=o.text, finish_reason=o.finish_reason,
            logprobs=None if req.logprobs is None else self.completion_logprobs(o.logprobs, 0))
            for i, o in enumerate(outputs)]
        return CompletionResponse(
            id=request_id, created=int(time.time()), model=self.model_name, choices=choices,
            usage=self.usage(prompts, sum(len(o.token_ids) for o in outputs)))

    async def completion_chunks(self, request_id: str, prompts: list[list[int]],
                                req: CompletionRequest,
                                choices: list[Choice]) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
            return sse(CompletionResponse(id=request_id, created=created,
                                          model=self.model_name, choices=choices, usage=usage))

        completion_tokens = 0
        async for d in merge_deltas(choices):
            new_logprobs = d.tokens if req.logprobs is not None else []
            if d.text or new_logprobs or d.output.finished:
                logprobs = (self.completion_logprobs(new_logprobs, d.text_offset)
                            if req.logprobs is not None else None)
                yield chunk([CompletionChoice(index=d.index, text=d.text, logprobs=logprobs,
                                              finish_reason=d.output.finish_reason)])
            if d.output.finished:
                completion_tokens += len(d.output.token_ids)
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], self.usage(prompts, completion_tokens))

    # ---------------------------------------------------------- tokens
    def tokenize(self, req: TokenizeRequest) -> dict:
        check_model_name(req.model, self.model_name)
        if req.messages:
            tokens = apply_chat_template(self.tokenizer, [m.as_dict() for m in req.messages])
        elif req.prompt is not None:
            tokens = self.encode(req.prompt, req.add_special_tokens)
        else:
            raise APIError(400, "Give either `prompt` or `messages`.", param="prompt")
        return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        check_model_name(req.model, self.model_name)
        return {"prompt": self.tokenizer.decode(self.checked_ids(req.tokens, "tokens"))}


def event_stream(chunks: AsyncIterator[str], choices: list[Choice]) -> StreamingResponse:
    """SSE around a chunk generator: an error after the stream started goes
    out as a `data: {"error": ...}` event; `data: [DONE]` always ends it.
    When the client hangs up, Starlette stops iterating and closes this
    generator, which aborts the choices that have not finished."""

    async def events() -> AsyncIterator[str]:
        try:
            async for event in chunks:
                yield event
        except Exception as exc:  # noqa: BLE001 - the headers are already sent
            log.exception("error while streaming")
            api = exc if isinstance(exc, APIError) else APIError(
                500, f"{type(exc).__name__}: {exc}", "internal_server_error")
            yield sse({"error": {"message": api.message, "type": api.type,
                                 "param": api.param, "code": api.code}})
        finally:
            await chunks.aclose()
            close_all(choices)
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


# -------------------------------------------------------------------- app
def build_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None,
              max_waiting: int = DEFAULT_MAX_WAITING,
              max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    serving = OpenAIServing(engine, model_name, max_waiting)
    app = FastAPI(title="Chapter 06: the OpenAI-compatible server", version=__version__)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyCheck, api_key=api_key)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    created = int(time.time())

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        return await serving.chat(req, request)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await serving.completion(req, request)

    @app.get("/v1/models")
    def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, created=created,
                                         max_model_len=serving.max_model_len)])

    @app.get("/health")
    def health() -> dict:
        if not engine.alive:
            raise APIError(503, f"The engine loop has died: {engine.dead!r}",
                           "server_error", code="engine_dead")
        return {"status": "ok"}

    @app.get("/version")
    def version() -> dict:
        return {"version": __version__, "torch": torch.__version__,
                "transformers": transformers.__version__}

    @app.get("/metrics")
    def metrics() -> Response:  # plain def: the scrape waits for the step lock in a thread
        body, content_type = serving.metrics.render()
        return Response(body, media_type=content_type)

    app.post("/tokenize")(serving.tokenize)
    app.post("/detokenize")(serving.detokenize)
    app.get("/stats")(engine.snapshot)
    return app


def parser():
    p = server_parser("Chapter 06: the OpenAI-compatible server (like `vllm serve`)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* (default: open)")
    p.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="most requests waiting for the scheduler; more get HTTP 503")
    return p


def main() -> None:
    args = parser().parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config = config_from_args(args)
    engine = AsyncLLMEngine.build(lambda: LLMEngine(config, policy="continuous"))
    app = build_app(engine, config.model_name, args.api_key, args.max_waiting)
    log.info("serving %s on http://%s:%d/v1", config.model_name, args.host, args.port)
    run_server(app, args.host, args.port)
