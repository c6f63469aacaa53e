"""The OpenAI-compatible server on the continuous-batching engine (ch06).

What an existing OpenAI app needs to work by changing only `base_url`.
`OpenAIServing` is chapters 03-05's `ChatServing` (the same validation,
the same engine requests, the same whole answers) plus:

- Server-Sent Events (`stream: true`) for chat and text completions, with
  `stream_options.include_usage`; `POST /v1/completions` (a prompt, several
  prompts, token ids); logprobs in both shapes;
- `GET /version`, `GET /metrics` (Prometheus, vLLM's names),
  `POST /tokenize`, `POST /detokenize`;
- `--api-key` on every route but those vLLM leaves open (401);
  `--max-waiting` backpressure (503 with `Retry-After`; a request with more
  choices than could ever be admitted is a 400); `--disable-fastapi-docs`;
- a client that goes away (stream closed, request dropped) has its request
  aborted, and its KV blocks freed, at the next engine step.

A request's way: pydantic validation -> chat template (in a worker thread)
-> token ids -> one engine request per choice (`AsyncLLMEngine.add_request`)
-> the choices' deltas merged as they come -> one JSON answer, or SSE chunks.

Left out: tool calls, structured output, the Responses API, embeddings,
several models per server, and byte-exact token strings in logprobs (a
token that holds part of a UTF-8 character shows as "\\ufffd").
"""
from __future__ import annotations

import json
import logging
import secrets
import sys
import time
from typing import AsyncIterator, Union

import torch
import transformers
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, ValidationInfo, field_validator
from starlette.concurrency import run_in_threadpool

from common import __version__
from common.config import config_from_args
from common.engine.async_llm import AsyncLLMEngine
from common.engine.llm_engine import LLMEngine
from common.engine.scheduler import ContinuousScheduler
from common.entrypoints.chat_server import (
    Answer,
    ChatServing,
    Choice,
    add_engine_routes,
    build_engine,
    check_model_name,
    close_all,
    engine_error,
    merge_choices,
    parse_server_args,
    server_parser,
    usage,
)
from common.entrypoints.launcher import serve
from common.entrypoints.metrics import Metrics
from common.entrypoints.protocol import (
    APIError,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChunkChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    StrictModel,
    Text,
    Usage,
    new_app,
    new_id,
    refuse_unless_default,
)
from common.layers.sampler import SampledToken
from common.loader import apply_chat_template
from common.sampling_params import SamplingParams

log = logging.getLogger("llm-course")

DEFAULT_MAX_WAITING = 256
RETRY_AFTER_S = 1
# What --api-key leaves open, as vLLM does: load balancers, Prometheus, the
# docs. Every other route, `/stats` and any route added later, needs the key.
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version", "/docs", "/docs/oauth2-redirect",
                          "/redoc", "/openapi.json"})


# ------------------------------------------------------ small request models
class TokenizeRequest(StrictModel):
    """vLLM's `/tokenize`: a prompt, or chat messages through the template."""
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True  # False is refused: the template always adds it
    return_token_strs: bool = False  # vLLM's: also each token as the tokenizer writes it

    @field_validator("add_generation_prompt")
    @classmethod
    def _generation_prompt(cls, value, info: ValidationInfo):
        return refuse_unless_default(cls, value, info)


class DetokenizeRequest(StrictModel):
    model: Text | None = None
    tokens: list[int] = Field(max_length=1 << 16)


# --------------------------------------------------------- ASGI middleware
class APIKeyCheck:
    """`--api-key`: every route but PUBLIC_PATHS needs `Authorization:
    Bearer KEY` (default-deny: `/stats` shows the engine's state and the
    prefix-cache hits, which can hint at other users' prompts). The scheme
    is case-insensitive (RFC 7235), the key compared in constant time."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(given, self.expected):
                error = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


def sse(payload: Union[BaseModel, dict, str]) -> str:
    """One Server-Sent Event: `data: ...` and a blank line."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json()
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


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
            yield sse(engine_error(exc).body())
        finally:
            await chunks.aclose()
            close_all(choices)
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


# ----------------------------------------------------------------- serving
class OpenAIServing(ChatServing):
    """Chapter 05's chat serving, plus streaming, completions, tokenization,
    metrics and backpressure."""

    streams = True
    fill_max_tokens = True  # a missing max_tokens: whatever fits
    observes_every_token = True  # TTFT and inter-token latencies, streamed or not

    def __init__(self, engine: AsyncLLMEngine, model_name: str, max_waiting: int,
                 metrics: Metrics | None = None):
        super().__init__(engine, model_name)
        self.max_waiting = max_waiting
        self.metrics = metrics or Metrics(engine.snapshot, model_name, lambda: engine.alive,
                                          max_model_len=engine.max_model_len,
                                          cache_config=engine.cache_config_info)

    def new_trackers(self, n: int, params: list[SamplingParams]) -> list:
        """Each choice's metrics; the n choices of a prompt share a parent."""
        parents = [self.metrics.parent(n) for _ in range(len(params) // n)]
        return [self.metrics.sequence(p.max_tokens, parents[k // n])
                for k, p in enumerate(params)]

    def check_ready(self, num_new: int) -> None:
        """Backpressure: refuse what would wait beyond --max-waiting."""
        if num_new > self.engine.max_num_seqs + self.max_waiting:
            raise APIError(400, f"This request asks for {num_new} sequences; at most "
                           f"{self.engine.max_num_seqs + self.max_waiting} can ever be "
                           "admitted at once (--max-num-seqs + --max-waiting).", param="n")
        waiting = self.engine.num_waiting(extra=num_new)  # if these were added
        if waiting > self.max_waiting:
            raise APIError(503, f"The server is overloaded: {self.engine.num_waiting()} "
                           f"requests are waiting for a slot (--max-waiting {self.max_waiting}). "
                           "Retry later.", "server_error", code="server_overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})

    # ------------------------------------------------------------ inputs
    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """A prompt, several prompts, token ids or several lists of ids
        (in a worker thread: tokenizing may take a while)."""
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]  # one prompt
        if not prompt or any(len(p) == 0 for p in prompt):
            raise APIError(400, "The prompt must not be empty.", param="prompt")
        return [self.encode(p) if isinstance(p, str) else self.check_token_ids(p, "prompt")
                for p in prompt]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    # ------------------------------------------------------------ outputs
    def completion_logprobs(self, tokens: list[SampledToken], offset: int) -> CompletionLogprobs:
        """`offset`: characters of this choice's tokens before these ones (their
        own text, not what has been released: a stop string holds text back).
        Each position's top logprobs include the sampled token, as OpenAI's
        and vLLM's do (up to `logprobs` + 1 entries)."""
        texts = [self.token_text(t.token_id) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        tops = []
        for text, t in zip(texts, tokens):
            top = {self.token_text(i): lp for i, lp in t.top_logprobs}
            top.setdefault(text, t.logprob)
            tops.append(top)
        return CompletionLogprobs(tokens=texts, token_logprobs=[t.logprob for t in tokens],
                                  top_logprobs=tops, text_offset=offsets)

    # --------------------------------------------------------- chat stream
    def stream_chat(self, request_id: str, prompt: list[int], req: ChatCompletionRequest,
                    choices: list[Choice]) -> StreamingResponse:
        return event_stream(self.chat_chunks(request_id, [prompt], req, choices), choices)

    async def chat_chunks(self, request_id: str, prompts: list[list[int]],
                          req: ChatCompletionRequest,
                          choices: list[Choice]) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChunkChoice], usage: Usage | None = None,
                  prompt_token_ids: list[int] | None = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created,
                                           model=self.model_name, choices=choices, usage=usage,
                                           prompt_token_ids=prompt_token_ids))

        for i in range(len(choices)):
            yield chunk([ChunkChoice(index=i, delta={"role": "assistant", "content": ""})],
                        prompt_token_ids=prompts[0] if req.return_token_ids and i == 0 else None)
        completion_tokens = 0
        async for i, out in merge_choices(choices):  # each output is a delta
            new_logprobs = out.logprobs if req.logprobs else []
            if out.text or new_logprobs or (req.return_token_ids and out.token_ids):
                yield chunk([ChunkChoice(
                    index=i, delta={"content": out.text},
                    logprobs=self.chat_logprobs(new_logprobs) if req.logprobs else None,
                    token_ids=out.token_ids if req.return_token_ids else None)])
            if out.finished:
                completion_tokens += out.num_output_tokens
                yield chunk([ChunkChoice(index=i, delta={}, finish_reason=out.finish_reason)])
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], usage(prompts, completion_tokens))

    # --------------------------------------------------- text completions
    async def completion(self, req: CompletionRequest, request: Request):
        check_model_name(req.model, self.model_name)
        prompts = await run_in_threadpool(self.completion_prompts, req)
        request_id = new_id("cmpl")
        choices = self.start(request_id, prompts, req, "prompt")
        if req.stream:
            return event_stream(self.completion_chunks(request_id, prompts, req, choices),
                                choices)
        answers = await self.answers(request, choices)
        return CompletionResponse(
            id=request_id, created=int(time.time()), model=self.model_name,
            choices=[self.completion_choice(i, a, req) for i, a in enumerate(answers)],
            usage=usage(prompts, sum(a.num_tokens for a in answers)))

    def completion_choice(self, index: int, answer: Answer,
                          req: CompletionRequest) -> CompletionChoice:
        logprobs = (None if req.logprobs is None
                    else self.completion_logprobs(answer.logprobs, 0))
        ids = req.return_token_ids
        return CompletionChoice(index=index, text="".join(answer.text), logprobs=logprobs,
                                finish_reason=answer.finish_reason,
                                token_ids=answer.token_ids if ids else None,
                                prompt_token_ids=answer.prompt_token_ids if ids else None)

    async def completion_chunks(self, request_id: str, prompts: list[list[int]],
                                req: CompletionRequest,
                                choices: list[Choice]) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
            return sse(CompletionResponse(id=request_id, created=created,
                                          model=self.model_name, choices=choices, usage=usage))

        completion_tokens = 0
        token_chars = [0] * len(choices)  # the text of the tokens so far, per choice (text_offset)
        first = [True] * len(choices)  # prompt_token_ids go in each choice's first chunk
        ids = req.return_token_ids
        async for i, out in merge_choices(choices):  # each output is a delta
            new_logprobs = out.logprobs if req.logprobs is not None else []
            if out.text or new_logprobs or out.finished or (ids and out.token_ids):
                logprobs = (self.completion_logprobs(new_logprobs, token_chars[i])
                            if req.logprobs is not None else None)
                if logprobs is not None:
                    token_chars[i] += sum(map(len, logprobs.tokens))
                prompt = out.prompt_token_ids if ids and first[i] else None
                first[i] = False
                yield chunk([CompletionChoice(index=i, text=out.text, logprobs=logprobs,
                                              finish_reason=out.finish_reason,
                                              token_ids=out.token_ids if ids else None,
                                              prompt_token_ids=prompt)])
            if out.finished:
                completion_tokens += out.num_output_tokens
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], usage(prompts, completion_tokens))

    # ---------------------------------------------------------- tokens
    def tokenize(self, req: TokenizeRequest) -> dict:
        """A plain def: FastAPI runs it in a worker thread."""
        check_model_name(req.model, self.model_name)
        if req.messages:
            tokens = apply_chat_template(self.tokenizer, [m.as_dict() for m in req.messages])
        elif req.prompt is not None:
            tokens = self.encode(req.prompt, req.add_special_tokens)
        else:
            raise APIError(400, "Give either `prompt` or `messages`.", param="prompt")
        answer = {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}
        if req.return_token_strs:
            answer["token_strs"] = self.tokenizer.convert_ids_to_tokens(tokens)
        return answer

    def detokenize(self, req: DetokenizeRequest) -> dict:
        check_model_name(req.model, self.model_name)
        return {"prompt": self.tokenizer.decode(self.check_token_ids(req.tokens, "tokens"))}


# -------------------------------------------------------------------- app
def build_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None,
              max_waiting: int = DEFAULT_MAX_WAITING, disable_docs: bool = False,
              metrics: Metrics | None = None) -> FastAPI:
    serving = OpenAIServing(engine, model_name, max_waiting, metrics)
    app = new_app("Chapter 06: the OpenAI-compatible server", __version__, disable_docs)
    if api_key:
        app.add_middleware(APIKeyCheck, api_key=api_key)
    add_engine_routes(app, serving)  # chapter 05's: models, health, chat, stats

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await serving.completion(req, request)

    @app.get("/version")
    def version() -> dict:
        return {"version": __version__, "torch": torch.__version__,
                "transformers": transformers.__version__}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:  # reads the last step's snapshot: no lock
        await app.state.monitoring.wait()
        body, content_type = serving.metrics.render()
        return Response(body, media_type=content_type)

    app.post("/tokenize")(serving.tokenize)
    app.post("/detokenize")(serving.detokenize)
    return app


def parser():
    p = server_parser("Chapter 06: the OpenAI-compatible server (like `vllm serve`)",
                      enable_prefix_caching=True)  # as chapter 05, and vLLM
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and "
                        "/detokenize (default: open)")
    p.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="most requests waiting for the scheduler; more get HTTP 503")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /docs, /redoc or /openapi.json")
    return p


def main() -> int:
    cli = parser()
    args = parse_server_args(cli)
    config = config_from_args(args)
    engine = build_engine(cli, lambda: LLMEngine(config, scheduler_cls=ContinuousScheduler))
    app = build_app(engine, config.model_name, args.api_key, args.max_waiting,
                    args.disable_fastapi_docs)
    log.info("serving %s on http://%s:%d/v1", config.model_name, args.host, args.port)
    return serve(app, args, engine)


if __name__ == "__main__":
    sys.exit(main())
