"""LLMEngine: add_request / step / abort, and its async front (ch03-05).

`LLMEngine.step()` is one iteration: ask the scheduler what runs, run the
model once on that flat batch, append the sampled tokens, detokenize, check
stop conditions, free the blocks of finished sequences, return what changed.

`AsyncLLMEngine` is what servers use: one background thread drives
`step()` while there is work; each request gets its own asyncio stream of
outputs; a request whose client goes away is aborted and its blocks freed at
the next step.

Left out: multiple processes (vLLM's v1 runs the engine core in its own
process and talks to the API server over ZeroMQ), LoRA, multimodal inputs.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import torch

from common.autoregressive import eos_token_ids
from common.engine.block_manager import BlockManager
from common.config import EngineConfig
from common.engine.detokenizer import IncrementalDetokenizer
from common.engine.kv_cache import KVCache, num_blocks_for_card
from common.loader import LoadedModel, load_model
from common.memory import Card
from common.engine.model_runner import ModelRunner
from common.layers.sampler import SampledToken
from common.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler
from common.engine.sequence import Sequence

log = logging.getLogger("llm-course")
LOG_INTERVAL_S = 5.0


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far
    text: str  # output text so far, stop strings removed and never leaked
    finished: bool
    finish_reason: str | None
    logprobs: list[SampledToken]
    num_cached_tokens: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    text: str = ""  # everything decoded so far
    stop_at: int | None = None  # cut position when a stop string matched


@dataclass
class EngineStats:
    prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    generation_tokens: int = 0
    peak_running: int = 0
    peak_reserved_slots: int = 0
    peak_used_slots: int = 0
    sum_reserved_slots: int = 0  # over steps, for the time-averaged waste
    sum_used_slots: int = 0
    finished: dict = field(default_factory=dict)  # finish reason -> count


class LLMEngine:
    def __init__(self, config: EngineConfig, policy: str = "continuous",
                 loaded: LoadedModel | None = None, num_blocks: int | None = None,
                 block_size_is_max_model_len: bool = False):
        """`policy`: "static" (ch03-04) or "continuous" (ch05).
        `block_size_is_max_model_len`: ch03's contiguous regions.
        `num_blocks`: a fixed cache size (tests) instead of sizing from the card."""
        self.config = config
        self.loaded = loaded or load_model(config.model, config.dtype, config.device,
                                           config.load_format, config.seed)
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(config.max_model_len or self.loaded.max_model_len,
                                 self.loaded.max_model_len)
        # ch03: one block of max_model_len slots per sequence = a contiguous region.
        self.block_size = self.max_model_len if block_size_is_max_model_len else config.block_size
        self.card = Card(self.loaded.device, config.device_memory_gb,
                         config.gpu_memory_utilization)
        self.card.charge_weights(self.loaded.model)
        if num_blocks is None:
            num_blocks, line = num_blocks_for_card(self.card, self.loaded.model,
                                                   self.block_size, config.max_num_batched_tokens)
            log.info(line)
        self.kv_cache = KVCache(self.card, self.loaded.model.config, num_blocks,
                                self.block_size, self.loaded.dtype)
        self.block_manager = BlockManager(num_blocks, self.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, policy, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        self.eos_token_ids = eos_token_ids(self.loaded.model, self.tokenizer)
        self.runner = ModelRunner(self.loaded.model, self.kv_cache, self.eos_token_ids)
        self.requests: dict[str, _Request] = {}
        self.stats = EngineStats()
        self._seed_counter = config.seed
        self._last_log = (time.monotonic(), 0, 0)  # time, prompt, generation tokens

    # ------------------------------------------------------------ requests
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Refuse at once what could never run (instead of hanging)."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {total} tokens ({len(prompt_token_ids)} in the "
                f"prompt, {params.max_tokens} for the completion).")
        needed = self.block_manager.blocks_needed(total)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"the request needs up to {needed} KV blocks but the cache only has "
                f"{self.block_manager.num_blocks}: it can never fit on this card")

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.check_request(prompt_token_ids, params)
        seed = params.seed
        if seed is None:  # unseeded requests still draw reproducibly per engine
            self._seed_counter += 1
            seed = self._seed_counter * 1_000_003
        seq = Sequence(request_id, list(prompt_token_ids), params,
                       generator=torch.Generator().manual_seed(seed))
        self.requests[request_id] = _Request(seq, IncrementalDetokenizer(self.tokenizer))
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish(request.seq, "abort")
            self._count_finished("abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        now = time.monotonic()
        for item in batch:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = now
        outputs = []
        for item, token in self.runner.run(batch):
            seq = item.seq
            start = seq.num_computed_tokens
            seq.num_computed_tokens += item.num_new_tokens
            self.stats.prompt_tokens += max(0, min(seq.num_computed_tokens,
                                                   seq.num_prompt_tokens) - start)
            self.block_manager.cache_full_blocks(seq)
            if token is not None:
                self.stats.generation_tokens += 1
                outputs.append(self._process_token(seq, token))
        self._update_stats()
        self._maybe_log()
        return outputs

    def _process_token(self, seq: Sequence, token: SampledToken) -> RequestOutput:
        request = self.requests[seq.request_id]
        seq.append(token)
        request.text += request.detokenizer.step(token.token_id)
        reason = self._check_stop_strings(request) or seq.check_stop(
            self.eos_token_ids, self.max_model_len)
        if reason is not None:
            if request.stop_at is None:
                request.text += request.detokenizer.flush()
            self.scheduler.finish(seq, reason)
            self._count_finished(reason)
            del self.requests[seq.request_id]
        return self._output(request)

    def _check_stop_strings(self, request: _Request) -> str | None:
        for stop in request.seq.params.stop:
            position = request.text.find(stop)
            if position != -1:
                request.stop_at = position if request.stop_at is None else min(
                    request.stop_at, position)
        return "stop" if request.stop_at is not None else None

    def _output(self, request: _Request) -> RequestOutput:
        seq = request.seq
        text = request.text
        if request.stop_at is not None:
            text = text[:request.stop_at]
        elif not seq.is_finished and seq.params.stop:
            # Hold back what could be the start of a stop string.
            text = text[:max(0, len(text) - max(len(s) for s in seq.params.stop) + 1)]
        return RequestOutput(
            seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids), text,
            seq.is_finished, seq.finish_reason, list(seq.output_logprobs),
            seq.num_cached_tokens, seq.arrival_time, seq.first_scheduled_time,
            seq.first_token_time)

    # ------------------------------------------------------------ figures
    def _count_finished(self, reason: str) -> None:
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    def kv_usage(self) -> dict:
        return self.block_manager.usage(self.scheduler.running)

    def _update_stats(self) -> None:
        usage = self.kv_usage()
        s = self.stats
        s.peak_running = max(s.peak_running, len(self.scheduler.running))
        s.peak_reserved_slots = max(s.peak_reserved_slots, usage["reserved_slots"])
        s.peak_used_slots = max(s.peak_used_slots, usage["used_slots"])
        s.sum_reserved_slots += usage["reserved_slots"]
        s.sum_used_slots += usage["used_slots"]

    def snapshot(self) -> dict:
        """Everything a learner may want to see, as one JSON-able dict."""
        usage = self.kv_usage()
        s, bm = self.stats, self.block_manager
        bytes_per_slot = KVCache.bytes_per_block(self.loaded.model.config, 1, self.loaded.dtype)
        return {
            "block_size": self.block_size, "num_blocks": bm.num_blocks,
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "kv_cache_usage_perc": usage["usage_perc"],
            "kv_reserved_slots": usage["reserved_slots"], "kv_used_slots": usage["used_slots"],
            "kv_waste_perc": usage["waste_perc"],
            "peak_running": s.peak_running,
            "peak_kv_reserved_bytes": s.peak_reserved_slots * bytes_per_slot,
            "peak_kv_used_bytes": s.peak_used_slots * bytes_per_slot,
            "avg_kv_waste_perc": (100.0 * (1 - s.sum_used_slots / s.sum_reserved_slots)
                                  if s.sum_reserved_slots else 0.0),
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": s.prompt_tokens, "generation_tokens": s.generation_tokens,
            "prefix_cache_queries": bm.prefix_queries, "prefix_cache_hits": bm.prefix_hits,
            "prefix_cache_hit_rate": bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0,
            "finished": dict(s.finished),
            "card": self.card.describe(),
        }

    def _maybe_log(self) -> None:
        """vLLM's periodic line: throughput, queues, KV usage, preemptions."""
        now = time.monotonic()
        last_time, last_prompt, last_gen = self._last_log
        if now - last_time < LOG_INTERVAL_S:
            return
        elapsed = now - last_time
        usage = self.kv_usage()
        log.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                 "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                 "KV waste: %.1f%%, Preemptions: %d",
                 (self.stats.prompt_tokens - last_prompt) / elapsed,
                 (self.stats.generation_tokens - last_gen) / elapsed,
                 len(self.scheduler.running), len(self.scheduler.waiting),
                 usage["usage_perc"], usage["waste_perc"], self.scheduler.num_preemptions)
        self._last_log = (now, self.stats.prompt_tokens, self.stats.generation_tokens)


class EngineDeadError(RuntimeError):
    pass


class AsyncLLMEngine:
    """A background thread drives `engine.step()`; each request is an async
    stream. Only that thread touches the engine."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wakeup = threading.Event()
        self._lock = threading.Lock()  # held during a step; snapshot() waits for it
        self.dead: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def build(cls, factory: Callable[[], LLMEngine]) -> "AsyncLLMEngine":
        """Run `factory` (load the model, size the cache) on a short-lived
        thread, then start the engine loop on its own thread.

        Why not on the main thread: on the CPU, torch's thread pool (OpenMP)
        belongs to the thread that first used it. Loading on the main thread
        and stepping on the loop thread would keep two pools of busy-waiting
        workers fighting over the cores: decode steps 15-20% slower on a
        2-core machine (measured). The build thread's pool ends with it."""
        built: dict = {}

        def run() -> None:
            try:
                built["engine"] = factory()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                built["error"] = exc

        thread = threading.Thread(target=run, name="engine-build")
        thread.start()
        thread.join()
        if "error" in built:
            raise built["error"]
        return cls(built["engine"])

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    def _send(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, request_id, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self.engine.abort(request_id)
                continue
            try:
                self.engine.add_request(request_id, *payload)
            except ValueError as exc:
                self._send(request_id, exc)

    def _loop(self) -> None:
        try:
            while True:
                if not self.engine.has_unfinished_requests() and self._inbox.empty():
                    self._wakeup.wait()
                    self._wakeup.clear()
                with self._lock:
                    self._drain_inbox()
                    try:
                        outputs = self.engine.step()
                    except Exception as exc:  # noqa: BLE001 - fail them, keep serving
                        log.exception("engine step failed; aborting the requests in flight")
                        self._fail_all(exc)
                        continue
                for output in outputs:
                    self._send(output.request_id, output)
        except BaseException as exc:  # noqa: BLE001 - the loop is dead: tell everyone
            self.dead = exc
            for request_id in list(self._streams):
                self._send(request_id, EngineDeadError(f"engine loop died: {exc!r}"))

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self._send(request_id, RuntimeError(f"internal engine error: {exc!r}"))

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> "RequestStream":
        """Queue a request for the engine loop now; read its outputs from the
        returned stream. Raises ValueError at once for what can never run."""
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        self.engine.check_request(prompt_token_ids, params)
        stream = RequestStream(self, request_id)
        self._streams[request_id] = (asyncio.get_running_loop(), stream.queue)
        self._inbox.put(("add", request_id, (prompt_token_ids, params)))
        self._wakeup.set()
        return stream

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yields a RequestOutput per new token; the last has finished=True.
        Closing the iterator early (client gone) aborts the request."""
        stream = self.add_request(request_id, prompt_token_ids, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def num_waiting(self) -> int:
        """Requests not yet running: in the inbox or the scheduler's queue
        (read without the step lock: a len() is atomic in CPython)."""
        return self._inbox.qsize() + len(self.engine.scheduler.waiting)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))
        self._wakeup.set()

    def snapshot(self) -> dict:
        with self._lock:
            return self.engine.snapshot()


class RequestStream:
    """One request's outputs, as an async iterator. `close()` before the
    end aborts the request (its blocks are freed at the next step)."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str):
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self._end()
            raise item
        if item.finished:
            self._end()
        return item

    def _end(self) -> None:
        self.finished = True
        self.engine._streams.pop(self.request_id, None)

    def close(self) -> None:
        if not self.finished:
            self._end()
            self.engine.abort(self.request_id)
