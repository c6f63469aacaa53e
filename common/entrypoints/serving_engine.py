"""The serving core (ch03): a validated OpenAI request -> engine requests -> outputs.

`OpenAIServing` (vLLM's base class, same name) is the only code that talks
to the engine (`AsyncLLM`). For every request it

1. checks what needs the model, once, before queueing anything: the model
   name (404), token ids in the vocabulary, the context and cache sizes
   (400 naming the field), the queue (ch06: `--max-waiting`, 503), a
   structured output's grammar (ch07, compiled in a worker thread);
2. queues one engine request per choice: choice k is sample k % n of
   prompt k // n; sample s of a seeded request gets seed + s, so the n
   choices differ yet replay the same;
3. merges the choices' outputs as they come (`outputs`: deltas, for a
   stream) or collects whole answers (`answers`: vLLM's FINAL_ONLY); a
   client that hangs up has its requests aborted, and their KV blocks
   freed, at the next engine step. The engine times the latencies itself.

One endpoint per file: serving_chat.py (ch03; streams ch06), serving_completion.py and
serving_tokenization.py (ch06). Chapter 06 adds backpressure, metrics, prompt logprobs.

Left out: beam search, LoRA adapters, priorities, several models.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from common.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError, RequestStream
from common.context_length import DEFAULT_MAX_TOKENS, ContextLengthError
from common.entrypoints.launcher import until_shutdown_deadline
from common.entrypoints.middleware import APIError, cancel_on_disconnect, internal_error
from common.entrypoints.request_checks import check_model_name, context_error
from common.entrypoints.protocol import SamplingFields
from common.entrypoints.responses import PromptTokensDetails, sse
from common.outputs import RequestOutput
from common.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:  # ch10's, imported by chapter 10 only
    from common.entrypoints.serving_models import OpenAIServingModels
    from common.lora.request import LoRARequest

log = logging.getLogger("llm-course")

RETRY_AFTER_S = 1
MAX_LOGPROBS = 20  # top logprobs per token at most: vLLM's --max-logprobs default


# ------------------------------------------------ checks every chapter shares
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


# ------------------------------------------------------------- the wire
def event_stream(events: AsyncIterator[str], streams: list[RequestStream],
                 request: Request) -> StreamingResponse:
    """SSE around an event generator (ch06): an error after the stream
    started goes out as a `data: {"error": ...}` event (so does the server's
    shutdown timeout, launcher.py); `data: [DONE]` always ends it. When the
    client hangs up, Starlette stops iterating and closes this generator,
    which aborts the choices that have not finished."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for event in until_shutdown_deadline(request.app, events):
                yield event
        except APIError as exc:  # the shutdown timeout: said, not a traceback
            log.warning("%s", exc.message)
            yield sse(exc.body())
        except Exception as exc:  # noqa: BLE001 - the headers are already sent
            log.exception("error while streaming")
            yield sse(engine_error(exc).body())
        finally:
            await events.aclose()
            close_all(streams)
        yield sse("[DONE]")

    return StreamingResponse(guarded(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def close_all(streams: list[RequestStream]) -> None:
    """Abort whatever has not finished (a no-op for finished choices)."""
    for stream in streams:
        stream.close()


# ----------------------------------------------------------------- serving
class OpenAIServing:
    """The serving core that every endpoint class extends."""

    def __init__(self, engine: AsyncLLM, model_name: str, *,
                 default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
                 max_waiting: int | None = None, metrics=None,
                 max_logprobs: int = MAX_LOGPROBS, prompt_tokens_details: bool = False,
                 models: OpenAIServingModels | None = None):
        """`default_max_tokens`: for a request that gives none (None: all
        that fits, as vLLM; ch06). `max_waiting`: most requests waiting for
        a slot, more get a 503 (None: no limit; ch06). `metrics`: where the
        `n` of each finished request goes (ch06). `max_logprobs`: top
        logprobs per token at most (vLLM's --max-logprobs).
        `prompt_tokens_details`: the usage says how many prompt tokens the
        prefix cache held (vLLM's --enable-prompt-tokens-details).
        `models` (ch10): the base model and its adapters, when it serves
        adapters (serving_models.py)."""
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.default_max_tokens = default_max_tokens
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.max_logprobs = max_logprobs
        self.prompt_tokens_details = prompt_tokens_details
        self.models = models

    # ------------------------------------------------------------ models
    def lora_request(self, requested: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (ch10), or None for the
        served model; any other name is a 404."""
        if self.models is not None:  # ch10
            return self.models.lora_request(requested)
        check_model_name(requested, self.model_name)
        return None

    def response_model(self, requested: str | None) -> str:
        """The `model` an answer names: the adapter asked for, or the served model."""
        if self.models is not None and requested in self.models.lora_requests:  # ch10
            return requested
        return self.model_name

    # -------------------------------------------------------- validation
    def check_token_ids(self, ids: list[int], param: str) -> list[int]:
        """A prompt's token ids, with vLLM's check and words: the lowest id
        if negative, else the highest."""
        if ids and (min(ids) < 0 or max(ids) >= self.engine.vocab_size):
            worst = min(ids) if min(ids) < 0 else max(ids)
            raise APIError(400, f"Token id {worst} is out of vocabulary", param=param)
        return ids

    def check_sampling_token_ids(self, ids: list[int], param: str) -> None:
        """`stop_token_ids` and `logit_bias`' keys, with vLLM's words: every
        id out of the vocabulary, and its size."""
        vocab_size = self.engine.vocab_size
        if invalid := [i for i in ids if i < 0 or i >= vocab_size]:
            raise APIError(400, f"token_id(s) {invalid} in {param} contain out-of-vocab "
                                f"token ids. Vocabulary size: {vocab_size}", param=param)

    def logprobs_count(self, count: int | None, kind: str, param: str) -> int | None:
        """Top logprobs per token, `kind` "sample" (the answer's) or "prompt";
        -1 (the vocabulary) or more than --max-logprobs: vLLM's 400."""
        vocab_size = self.engine.vocab_size
        count = vocab_size if count == -1 else count
        cap = vocab_size if self.max_logprobs == -1 else self.max_logprobs
        if count is not None and count > cap:
            raise APIError(400, f"Requested {kind} logprobs of {count}, which is greater "
                                f"than max allowed: {cap}", param=param)
        return count

    def sampling_params(self, req: SamplingFields, prompt_ids: list[int], sample: int,
                        param: str) -> SamplingParams:
        """The engine's SamplingParams for one choice, checked once against
        the vocabulary and the engine's rules (context length, cache size)."""
        max_tokens = req.requested_max_tokens() or self.engine.default_max_tokens(
            len(prompt_ids), cap=self.default_max_tokens)
        self.check_sampling_token_ids(req.stop_token_ids or [], "stop_token_ids")
        self.check_sampling_token_ids(list(req.logit_bias_ids()), "logit_bias")
        params = SamplingParams(
            temperature=req.temperature, top_p=req.top_p,
            top_k=req.top_k if req.top_k > 0 else -1,  # 0 and -1 both mean off, as in vLLM
            min_p=req.min_p, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
            logit_bias=req.logit_bias_ids(), seed=None if req.seed is None else req.seed + sample,
            max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop_strings(),
            stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
            logprobs=self.logprobs_count(req.logprobs_count(), "sample", req.LOGPROBS_PARAM),
            prompt_logprobs=self.logprobs_count(req.prompt_logprobs_count(), "prompt",
                                                "prompt_logprobs"),
            structured_outputs=req.structured_outputs_params()[0],  # ch07
            # a whole answer needs only the final output (vLLM's FINAL_ONLY): one
            # message from the engine thread per request instead of one per token
            output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY)
        try:
            self.engine.check_request(len(prompt_ids), params)
        except ContextLengthError as exc:
            raise context_error(exc, param) from None
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from None
        return params

    async def compile_grammar(self, req: SamplingFields) -> None:
        """ch07: compile a structured output in a worker thread (cached); refused: a 400."""
        params, param = req.structured_outputs_params()
        try:
            if params is not None:
                await run_in_threadpool(self.engine.compile_grammar, params)
        except ValueError as exc:  # GrammarError
            raise APIError(400, str(exc), param=param) from None

    def check_capacity(self, num_new: int) -> None:
        """Backpressure (ch06): refuse what would wait beyond --max-waiting."""
        if self.max_waiting is None:
            return
        most = self.engine.max_num_seqs + self.max_waiting
        if num_new > most:
            raise APIError(400, f"This request asks for {num_new} sequences; at most "
                           f"{most} can ever be admitted at once (--max-num-seqs + "
                           "--max-waiting).", param="n")
        if self.engine.num_waiting(extra=num_new) > self.max_waiting:  # if these were added
            raise APIError(503, f"The server is overloaded: {self.engine.num_waiting()} "
                           f"requests are waiting for a slot (--max-waiting {self.max_waiting}). "
                           "Retry later.", "server_error", code="server_overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})

    # ----------------------------------------------------------- engine
    def start(self, request_id: str, prompts: list[list[int]], req: SamplingFields,
              param: str, lora_request: LoRARequest | None = None) -> list[RequestStream]:
        """Validate everything first, then queue one engine request per
        choice: choice k is sample k % n of prompt k // n. `lora_request`
        (ch10): the adapter they all run with."""
        prepared = [(ids, self.sampling_params(req, ids, sample, param))
                    for ids in prompts for sample in range(req.n)]
        self.check_capacity(len(prepared))
        try:
            return [self.engine.add_request(f"{request_id}-{k}", ids, params,
                                            lora_request=lora_request)
                    for k, (ids, params) in enumerate(prepared)]
        except EngineDeadError as exc:
            raise engine_error(exc) from None

    async def outputs(self, streams: list[RequestStream], n: int
                      ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The choices' outputs interleaved as they come: (choice index,
        its RequestOutput). An engine error ends them as an APIError; closing this
        iterator aborts every unfinished choice."""
        queue: asyncio.Queue = asyncio.Queue()
        generated: dict[int, list[int]] = {}  # prompt -> tokens of its finished choices

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((index, output))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((index, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        remaining = len(streams)
        try:
            while remaining:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise engine_error(item)
                completion = item.outputs[0]  # one per engine request (n fans out here)
                if completion.finished:
                    remaining -= 1
                    self._finished_choice(generated, index // n, n, completion.num_output_tokens)
                yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            close_all(streams)

    def _finished_choice(self, generated: dict[int, list[int]], prompt: int, n: int,
                         num_tokens: int) -> None:
        """ch06: once the n choices of a prompt have finished, its `n` metrics."""
        done = generated.setdefault(prompt, [])
        done.append(num_tokens)
        if self.metrics is not None and len(done) == n:
            self.metrics.record_parent(n, done)

    async def answers(self, request: Request, streams: list[RequestStream],
                      n: int) -> list[RequestOutput]:
        """Each choice's whole answer (its one FINAL_ONLY output), for a
        non-streaming response."""
        async def collect() -> list[RequestOutput]:
            answers: list[RequestOutput | None] = [None] * len(streams)
            async for index, output in self.outputs(streams, n):
                answers[index] = output
            return answers

        try:
            return await cancel_on_disconnect(request, collect())
        finally:
            close_all(streams)

    def prompt_details(self, prompts: list[list[int]], first_outputs: list[RequestOutput | None],
                       with_created: bool = True) -> PromptTokensDetails | None:
        """vLLM's `usage.prompt_tokens_details`, with --enable-prompt-tokens-details:
        the prompt tokens the prefix cache held (from each prompt's first
        choice: its choices share the prompt), and those the request added
        to it (the prompt's full blocks it did not find; none without
        prefix caching; `with_created` False: not said, as vLLM's
        completion streams)."""
        if not self.prompt_tokens_details:
            return None
        info = self.engine.cache_config_info
        block_size = info["block_size"] if info["enable_prefix_caching"] else None
        cached = created = 0
        for prompt, output in zip(prompts, first_outputs):
            hit = output.num_cached_tokens if output is not None else 0
            cached += hit
            if block_size:
                created += max(0, len(prompt) // block_size * block_size - hit)
        return PromptTokensDetails(cached_tokens=cached,
                                   created_cache_tokens=created if with_created else None)

    # ----------------------------------------------------------- tokens
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
