"""The chat server of chapters 01-05 (ch01), and the request path chapter 06 extends.

Two ways to answer `POST /v1/chat/completions`:

- chapter 01, `build_chat_app(generate)`: a plain `def` endpoint, which
  FastAPI runs in a worker thread per request, around the chapter's own
  `generate` function (the loop by hand); chapter 02 writes the same
  endpoint out around `model.generate`, in its server.py;
- chapters 03-05, `ChatServing` on the engine (`AsyncLLMEngine`): the
  request is validated once, here, into engine requests (one per choice:
  `n` choices of a seeded request get seeds seed, seed+1, ...), queued,
  and answered from the engine's text (stop strings cut off). Chapter 06's
  `OpenAIServing` is this class plus streaming and the rest of the API.

Every chapter shares the rest: OpenAI's error envelope, 400 for bad input
naming its `param` (common/entrypoints/protocol.py), a 1 MiB body limit,
tokenization in a worker thread (never on the event loop, where it would
stall every other request), `/health`, a read deadline (408) and a bounded
graceful shutdown (common/entrypoints/launcher.py), and, on the engine,
503 `engine_dead` then exit code 1 if the engine loop dies, so that a
supervisor restarts the server (what vLLM does).

Left out: streaming and the rest of the OpenAI API (chapter 06).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Literal

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from common import __version__
from common.config import ConfigError, add_engine_args, config_from_args, resolve_model_flags
from common.engine.async_llm import (
    AsyncLLMEngine,
    EngineDeadError,
    RequestFailedError,
    RequestStream,
)
from common.engine.llm_engine import (
    ContextLengthError,
    LLMEngine,
    check_context_length,
    default_max_tokens,
)
from common.engine.output_processor import RequestOutput
from common.engine.scheduler import Scheduler
from common.entrypoints.launcher import add_http_args, serve
from common.entrypoints.protocol import (
    APIError,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ModelCard,
    ModelList,
    ResponseMessage,
    SamplingFields,
    TokenLogprob,
    TopLogprob,
    Usage,
    internal_error,
    new_app,
    new_id,
)
from common.layers.sampler import SampledToken
from common.loader import apply_chat_template
from common.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger("llm-course")

DISCONNECT_POLL_S = 0.25
MONITORING_PER_S = 20  # answers a second on /stats and /metrics, all clients together


# ------------------------------------------------------- shared checks
def check_model_name(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(404, f"The model `{requested}` does not exist.",
                       "not_found_error", "model", "model_not_found")


def check_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int,
                  param: str) -> None:
    """The engine's context rule, as a 400 naming the prompt's field."""
    try:
        check_context_length(num_prompt_tokens, max_tokens, max_model_len)
    except ContextLengthError as exc:
        raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None


def engine_error(exc: BaseException) -> APIError:
    """What a request's client sees when the engine could not serve it."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"The engine is not running ({exc}); the server is "
                        "shutting down.", "server_error", code="engine_dead")
    if isinstance(exc, RequestFailedError):
        return APIError(500, f"This request failed inside the engine: {exc}",
                        "internal_server_error")
    return internal_error(exc)


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


def usage(prompts: list[list[int]], completion_tokens: int) -> Usage:
    prompt_tokens = sum(len(p) for p in prompts)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


# ---------------------------------------------------- chapter 01: a function
@dataclass
class Completion:
    """What chapter 01's `generate` returns for one prompt."""
    token_ids: list[int]
    finish_reason: Literal["stop", "length"]


GenerateFn = Callable[[list[int], ChatCompletionRequest, int, "int | None"], Completion]

# Sampling fields of the engine (ch03+) that chapter 01 does not implement:
# refused with a 400 when a request sets them, never silently ignored.
ENGINE_ONLY_FIELDS = ("top_p", "stop", "presence_penalty", "frequency_penalty",
                      "logit_bias", "top_k", "min_p", "repetition_penalty", "min_tokens",
                      "stop_token_ids", "logprobs", "return_token_ids")


def refuse_unimplemented(req: ChatCompletionRequest, implemented: set[str]) -> None:
    defaults = ChatCompletionRequest.model_fields
    for name in ENGINE_ONLY_FIELDS:
        if name not in implemented and getattr(req, name) != defaults[name].default:
            raise APIError(400, f"`{name}` is not implemented by this chapter's server "
                           "(our engine, from chapter 03 on, implements it).", param=name)
    if req.stream:
        raise APIError(400, "This chapter's server does not stream; chapter 06's does.",
                       param="stream")


def build_chat_app(title: str, model_name: str, max_model_len: int, tokenizer,
                   generate: GenerateFn, implemented: set[str] = frozenset(),
                   serialize: bool = False) -> FastAPI:
    """FastAPI app with `/v1/models`, `/health` and `/v1/chat/completions`.

    `generate(prompt_ids, request, max_tokens, seed)` is the chapter's
    model. The endpoint is a plain `def`: FastAPI runs it in its thread
    pool, one thread per request; `serialize=True` puts a lock around
    `generate` (chapter 01 runs one request at a time). Chapter 02 writes
    the same endpoint out in its server.py, as the source material does.
    `implemented`: the optional sampling fields `generate` honours.
    """
    app = new_app(title, __version__)
    created = int(time.time())
    lock = threading.Lock() if serialize else contextlib.nullcontext()

    @app.get("/v1/models")
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
        refuse_unimplemented(req, implemented)
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


# ----------------------------------------------- chapters 03-06: the engine
def sampling_params_from_request(req: SamplingFields, max_tokens: int, sample: int = 0,
                                 logprobs: int | None = None,
                                 output_kind: RequestOutputKind = RequestOutputKind.DELTA
                                 ) -> SamplingParams:
    """The engine's SamplingParams for choice `sample` of a request: sample
    k of a seeded request gets seed + k, so the n choices differ yet replay
    the same. `output_kind`: a delta per token (streams, latency metrics)
    or only the final output (a whole answer)."""
    return SamplingParams(
        temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k if req.top_k > 0 else -1,  # 0 and -1 both mean off, as in vLLM
        min_p=req.min_p,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias_ids(),
        seed=None if req.seed is None else req.seed + sample,
        max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop_strings(),
        stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos, logprobs=logprobs,
        output_kind=output_kind)


@dataclass
class Choice:
    """One of a response's n choices: an engine request, and (ch06) the
    tracker that observes its latencies."""
    stream: RequestStream
    tracker: object | None = None  # ch06: its metrics (SequenceMetrics)


def close_all(choices: list[Choice]) -> None:
    """Abort whatever has not finished (a no-op for finished choices)."""
    for choice in choices:
        choice.stream.close()


async def merge_choices(choices: list[Choice]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the choices' outputs (deltas) as they come: (choice index,
    output). An engine error ends the merge as an APIError. Closing this
    iterator aborts every unfinished choice."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, choice: Choice) -> None:
        try:
            async for output in choice.stream:
                if choice.tracker is not None:
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
                raise engine_error(item)
            remaining -= item.finished
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        close_all(choices)


@dataclass
class Answer:
    """One choice's whole answer, collected from its deltas (or its one
    final output)."""
    text: list[str] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None

    def add(self, output: RequestOutput) -> None:
        self.prompt_token_ids = output.prompt_token_ids
        self.text.append(output.text)
        self.logprobs += output.logprobs
        self.token_ids += output.token_ids
        self.num_tokens = output.num_output_tokens
        self.finish_reason = output.finish_reason


class ChatServing:
    """Chat completions on the engine, whole answers (ch03). The only part
    of chapters 03-05 that talks to the AsyncLLMEngine."""

    streams = False  # ch06: OpenAIServing streams
    fill_max_tokens = False  # ch06: a missing max_tokens fills the context
    observes_every_token = False  # ch06: latency metrics need a delta per token

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len

    # -------------------------------------------------------- validation
    def check_token_ids(self, ids: list[int], param: str) -> list[int]:
        bad = [i for i in ids if not 0 <= i < self.engine.vocab_size]
        if bad:
            raise APIError(400, f"Token id {bad[0]} is out of range [0, "
                           f"{self.engine.vocab_size}).", param=param)
        return ids

    def check_ready(self, num_new: int) -> None:
        """Room for `num_new` more requests? (ch06: --max-waiting)"""

    def sampling_params(self, req: SamplingFields, prompt_ids: list[int], sample: int,
                        param: str) -> SamplingParams:
        """The engine's SamplingParams for one choice, checked once against
        the vocabulary and the engine's rules (context length, cache size)."""
        max_tokens = req.requested_max_tokens() or self.engine.default_max_tokens(
            len(prompt_ids), fill=self.fill_max_tokens)
        self.check_token_ids(req.stop_token_ids or [], "stop_token_ids")
        self.check_token_ids(list(req.logit_bias_ids()), "logit_bias")
        # A whole answer needs only the final output (vLLM's FINAL_ONLY): one
        # message from the engine thread per request instead of one per token.
        per_token = req.stream or self.observes_every_token
        params = sampling_params_from_request(
            req, max_tokens, sample, req.logprobs_count(),
            RequestOutputKind.DELTA if per_token else RequestOutputKind.FINAL_ONLY)
        try:
            self.engine.check_request(len(prompt_ids), params)
        except ContextLengthError as exc:
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from None
        return params

    def start(self, request_id: str, prompts: list[list[int]], req: SamplingFields,
              param: str) -> list[Choice]:
        """Validate everything first, then queue one engine request per
        choice: choice k is sample k % n of prompt k // n."""
        prepared = [(ids, self.sampling_params(req, ids, sample, param))
                    for ids in prompts for sample in range(req.n)]
        self.check_ready(len(prepared))
        trackers = self.new_trackers(req.n, [params for _, params in prepared])
        try:
            return [Choice(self.engine.add_request(f"{request_id}-{k}", ids, params), tracker)
                    for k, ((ids, params), tracker) in enumerate(zip(prepared, trackers))]
        except EngineDeadError as exc:
            raise engine_error(exc) from None

    def new_trackers(self, n: int, params: list[SamplingParams]) -> list:
        """What observes each choice (n per prompt): nothing here (ch06: metrics)."""
        return [None] * len(params)

    # ------------------------------------------------------------ inputs
    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        """The messages through the chat template (in a worker thread)."""
        return apply_chat_template(self.tokenizer, req.message_dicts())

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

    @staticmethod
    async def answers(request: Request, choices: list[Choice]) -> list[Answer]:
        """Each choice's whole answer, for a non-streaming response."""
        async def collect() -> list[Answer]:
            answers = [Answer() for _ in choices]
            async for index, output in merge_choices(choices):
                answers[index].add(output)
            return answers

        try:
            return await cancel_on_disconnect(request, collect())
        finally:
            close_all(choices)

    # -------------------------------------------------------------- chat
    async def chat(self, req: ChatCompletionRequest, request: Request):
        check_model_name(req.model, self.model_name)
        if req.stream and not self.streams:
            raise APIError(400, "This chapter's server does not stream; chapter 06's does.",
                           param="stream")
        prompt = await run_in_threadpool(self.chat_prompt, req)
        request_id = new_id("chatcmpl")
        choices = self.start(request_id, [prompt], req, "messages")
        if req.stream:
            return self.stream_chat(request_id, prompt, req, choices)
        answers = await self.answers(request, choices)
        return ChatCompletionResponse(
            id=request_id, created=int(time.time()), model=self.model_name,
            choices=[ChatChoice(index=i, message=ResponseMessage(content="".join(a.text)),
                                finish_reason=a.finish_reason,
                                logprobs=self.chat_logprobs(a.logprobs) if req.logprobs else None,
                                token_ids=a.token_ids if req.return_token_ids else None)
                     for i, a in enumerate(answers)],
            usage=usage([prompt], sum(a.num_tokens for a in answers)),
            prompt_token_ids=prompt if req.return_token_ids else None)

    def stream_chat(self, request_id: str, prompt: list[int], req: ChatCompletionRequest,
                    choices: list[Choice]):
        raise NotImplementedError  # ch06: OpenAIServing.stream_chat


class RateLimit:
    """At most `per_second` answers a second on the routes that share it,
    all clients together; a request beyond that waits its turn on the event
    loop (asleep: no thread, no CPU). Why: once `/stats` answers at once, 60
    clients looping on it would take the CPU from the engine (on 2 cores,
    a long request beside them ran many times slower); a monitor needs a
    few answers a second, not thousands."""

    def __init__(self, per_second: float):
        self.interval = 1.0 / per_second
        self.next_slot = 0.0

    async def wait(self) -> None:
        now = time.monotonic()
        slot = max(now, self.next_slot)  # the first free slot, reserved at once
        self.next_slot = slot + self.interval
        await asyncio.sleep(slot - now)


def add_engine_routes(app: FastAPI, serving: ChatServing) -> None:
    """The routes of chapters 03-06: models, health, chat, stats. `/stats`
    (and chapter 06's `/metrics`) share `app.state.monitoring`, a RateLimit."""
    created = int(time.time())
    engine = serving.engine
    app.state.monitoring = RateLimit(MONITORING_PER_S)

    @app.get("/v1/models")
    def models() -> ModelList:
        return ModelList(data=[ModelCard(id=serving.model_name, created=created,
                                         max_model_len=serving.max_model_len)])

    @app.get("/health")
    async def health() -> dict:  # on the event loop: no worker thread needed
        if not engine.alive:
            raise engine_error(EngineDeadError(f"the engine loop has died: {engine.dead!r}"))
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        return await serving.chat(req, request)

    @app.get("/stats")
    async def stats() -> dict:  # the figures published after the last step: no lock
        await app.state.monitoring.wait()
        return engine.snapshot()


# ------------------------------------------------------- command line
def server_parser(description: str, enable_prefix_caching: bool = False
                  ) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0 exposes it to the network)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    add_http_args(parser)
    add_engine_args(parser, enable_prefix_caching)
    return parser


def parse_server_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    args = parser.parse_args()
    resolve_model_flags(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return args


def build_engine(parser: argparse.ArgumentParser,
                 factory: Callable[[], LLMEngine]) -> AsyncLLMEngine:
    """`AsyncLLMEngine.build`, where flags that do not fit the model
    (`--tensor-parallel-size 2` for 9 heads, ch06) exit as a usage error."""
    try:
        return AsyncLLMEngine.build(factory)
    except ConfigError as exc:
        parser.error(str(exc))


def main(title: str, scheduler_cls: type[Scheduler], contiguous: bool = False,
         max_num_seqs: int | None = None, enable_prefix_caching: bool = False) -> int:
    """Chapters 03-05: parse the flags, build the engine with the chapter's
    components, serve chat completions. `enable_prefix_caching`: the
    default of `--enable-prefix-caching` (`--no-enable-prefix-caching`)."""
    parser = server_parser(title, enable_prefix_caching)
    args = parse_server_args(parser)
    config = config_from_args(args)
    if max_num_seqs is not None:
        config.max_num_seqs = max_num_seqs
    engine = build_engine(parser, lambda: LLMEngine(
        config, scheduler_cls=scheduler_cls, block_size_is_max_model_len=contiguous))
    app = new_app(title, __version__)
    add_engine_routes(app, ChatServing(engine, config.model_name))
    return serve(app, args, engine)
