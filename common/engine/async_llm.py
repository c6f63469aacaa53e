"""AsyncLLM (vLLM v1's name and file): the engine behind a server (ch03-06).

One background thread drives `LLMEngine.step()` while there is work; each
request gets its own asyncio stream of outputs. Servers only talk to this
class: they never touch the engine's scheduler or blocks.

- A request whose client goes away is aborted, and its blocks freed, at
  the next step (`RequestStream.close`).
- A request that fails inside the engine (its row could not be sampled,
  its output not processed) gets `RequestFailedError`; the others go on.
  A step that fails as a whole (the forward pass) fails the requests of
  that step, and the loop keeps serving.
- If the loop itself dies, every stream gets `EngineDeadError`, `alive`
  turns false and `died` is set, so a server can answer 503 and exit.
  A tensor-parallel rank that dies (ch08: `RankDiedError`) kills the loop:
  the ranks are out of step for good.
- `num_waiting()` counts the requests that would not run at the next step:
  what a server's backpressure (`--max-waiting`, ch06) needs.
- `snapshot()` (what `/stats` and `/metrics` show) reads the figures the
  loop published after its last step: it never waits for a step, so a
  client polling `/stats` cannot slow the engine or the other requests.
- A request's `arrival_time` is when it reached `add_request`, on the
  event loop: its time to first token and e2e latency (timed by the
  engine, ch06) include its wait for the loop thread to take it in.
  `add_stat_logger` (ch06: the Prometheus `Metrics`) gets each step's
  `IterationStats`, on the loop thread.
- `watch()` switches on the engine's step events for the live view
  (common/entrypoints/live_view.py); its subscribers run on the loop thread.

`EngineClient` is what every front shares (vLLM's name,
vllm/engine/protocol.py): one async stream per request, the engine's
published figures, its death. `AsyncLLM` runs the engine on a thread of
the server's own process (ch03-08); chapter 09's `AsyncMPClient`
(common/engine/core_client.py) runs it in processes of its own, over
ZeroMQ, as vLLM v1 does by default.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from common.engine.llm_engine import LLMEngine, step_or_fail
from common.metrics.step_events import Subscriber
from common.outputs import FinishReason, RequestOutput
from common.sampling_params import SamplingParams, StructuredOutputsParams

log = logging.getLogger("llm-course")


class EngineDeadError(RuntimeError):
    """The engine loop is not running: nothing will be generated."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine; the others go on."""


@dataclass
class QueueCounts:
    """One engine's counts behind `num_waiting()`. Each field has one
    writer thread: `num_added` the server's, the others the thread that
    reads the engine's steps."""
    free_slots: int  # sequence slots free after the last step
    num_added: int = 0  # requests handed to the engine
    num_drained: int = 0  # requests the engine took in and stepped
    left_waiting: int = 0  # queued after the last step

    def num_waiting(self, extra: int = 0) -> int:
        """Requests that will not run at the next step (with `extra` more
        arrivals): those the last step left waiting, plus new arrivals
        beyond the sequence slots it left free. (An arrival that finds a
        slot but no free block counts from the step after: a step late,
        never wrongly refused.)"""
        arrivals = self.num_added - self.num_drained + extra
        return self.left_waiting + max(0, arrivals - self.free_slots)


@dataclass
class WatchedEngine:
    """One engine as the live view sees it: what it says of itself once
    (`LLMEngine.describe()`), and a way to receive each step's frame
    (`subscribe(callback)`, called on a thread that is not the event loop's)."""
    description: dict
    subscribe: Callable[[Subscriber], None]


class EngineClient:
    """What a server talks to: requests in, each with its own async stream
    of outputs; the engine's figures as of its last step. Subclasses say
    where the engine runs (`_submit_add`, `_submit_abort`, `alive`) and
    answer the servers' questions (`check_request`, ...)."""

    # Set by subclasses, read by servers.
    tokenizer = None
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    cache_config_info: dict  # static: vllm:cache_config_info

    def __init__(self) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.dead: BaseException | None = None
        self.died = threading.Event()
        # The engine's figures after its last step: replaced whole (never
        # changed in place), so readers on other threads need no lock.
        self._published: dict = {}

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def snapshot(self) -> dict:
        """The engine's figures as of its last step (no lock, no waiting)."""
        stats = dict(self._published)
        stats["engine_alive"] = self.alive
        stats["engine_error"] = None if self.dead is None else repr(self.dead)
        return stats

    def watch(self) -> list[WatchedEngine]:
        """Each engine behind this client, for the live view (`--live-view`)."""
        raise NotImplementedError

    # ------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    lora_request=None) -> "RequestStream":
        """Queue a validated request for the engine now; read its outputs
        from the returned stream. `arrival_time` (`time.monotonic()`): now
        unless given (a server may pass when the HTTP request came in).
        `lora_request` (ch10): its adapter, a LoRARequest, or None."""
        if arrival_time is None:
            arrival_time = time.monotonic()
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        stream = RequestStream(self, request_id)
        self._streams[request_id] = (asyncio.get_running_loop(), stream.queue)
        self._submit_add(request_id, list(prompt_token_ids), params, arrival_time, lora_request)
        return stream

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, lora_request=None
                       ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs; the last has finished=True.
        Closing the iterator early (client gone) aborts the request."""
        stream = self.add_request(request_id, prompt_token_ids, params,
                                  lora_request=lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        self._submit_abort(request_id)

    def _submit_add(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float, lora_request=None) -> None:
        raise NotImplementedError

    def _submit_abort(self, request_id: str) -> None:
        raise NotImplementedError

    # ----------------------------------------------- outputs to the streams
    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def _send(self, request_id: str, item) -> None:
        """Hand an output (or an exception) to its stream, from any thread."""
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, q = stream
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # its event loop is closed: the server has stopped
                pass

    def _deliver(self, outputs: list[RequestOutput], failed: list[tuple[str, str]]) -> None:
        """One step's outputs to their streams; a request that failed in
        the engine gets `RequestFailedError`, the others go on."""
        for request_id, error in failed:
            self._send(request_id, RequestFailedError(error))
        for output in outputs:
            completion = output.outputs[0]
            if completion.finish_reason is FinishReason.ERROR:
                self._send(output.request_id, RequestFailedError(completion.error))
            else:
                self._send(output.request_id, output)

    def _die(self, exc: BaseException) -> None:
        """The engine is gone for good: every stream gets `EngineDeadError`."""
        self.dead = exc
        self.died.set()
        for request_id in list(self._streams):
            self._send(request_id, EngineDeadError(f"the engine loop died: {exc!r}"))


class AsyncLLM(EngineClient):
    """A background thread drives `engine.step()`; each request is an async
    stream. Only that thread touches the engine."""

    def __init__(self, engine: LLMEngine):
        super().__init__()
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.max_num_seqs = engine.scheduler.max_num_seqs
        self.cache_config_info = engine.cache_config_info()
        self._inbox: queue.Queue = queue.Queue()
        self._wakeup = threading.Event()
        self._lock = threading.Lock()  # held during a step; close() waits for it
        self._closed = False  # set by close(): the loop ends before its next step
        self._counts = QueueCounts(free_slots=self.max_num_seqs)
        self._published = engine.snapshot()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def build(cls, factory: Callable[[], LLMEngine]) -> "AsyncLLM":
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

    # ------------------------------------------------------ what servers ask
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """The engine's admission rules (context length, cache size)."""
        self.engine.check_request(num_prompt_tokens, params)

    def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """ch07: compile a structured output's grammar. Servers call it in a
        worker thread, as vLLM calls one xgrammar compiler from a thread pool
        (xgrammar compiles in parallel and caches what it compiled)."""
        self.engine.compile_grammar(params)

    def default_max_tokens(self, num_prompt_tokens: int, cap: int | None) -> int:
        return self.engine.default_max_tokens(num_prompt_tokens, cap)

    def num_waiting(self, extra: int = 0) -> int:
        """Requests that will not run at the next step (`QueueCounts`)."""
        return self._counts.num_waiting(extra)

    def close(self) -> None:
        """Stop the engine loop between steps, then the engine's
        tensor-parallel workers (ch08). No step runs after it: a step still
        inside torch while the interpreter exits aborts the process
        ("terminate called without an active exception")."""
        with self._lock:
            self._closed = True
            self.engine.close()
        self._wakeup.set()  # an idle loop wakes, sees `_closed` and ends
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def add_stat_logger(self, logger) -> None:
        """ch06: `logger.record(iteration_stats)` after every step, called
        on the engine loop's thread (see `LLMEngine.add_stat_logger`)."""
        self.engine.add_stat_logger(logger)

    def watch(self) -> list[WatchedEngine]:
        """The live view's one engine: its step events, switched on between
        two steps."""
        with self._lock:
            events = self.engine.enable_step_events()
        return [WatchedEngine(self.engine.describe(), events.subscribe)]

    # ------------------------------------------------------------ requests
    def _submit_add(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float, lora_request=None) -> None:
        self._counts.num_added += 1
        self._inbox.put(("add", request_id, (prompt_token_ids, params, arrival_time,
                                             lora_request)))
        self._wakeup.set()

    def _submit_abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))
        self._wakeup.set()

    # ------------------------------------------------------------ the loop
    def _drain_inbox(self) -> int:
        """Hand queued requests and aborts to the engine; returns the adds."""
        added = 0
        while True:
            try:
                kind, request_id, payload = self._inbox.get_nowait()
            except queue.Empty:
                return added
            if kind == "abort":
                self.engine.abort(request_id)
                continue
            added += 1
            try:
                self.engine.add_request(request_id, *payload)
            except ValueError as exc:  # a duplicate request id
                self._send(request_id, exc)

    def _loop(self) -> None:
        try:
            while True:
                if not self.engine.has_unfinished_requests() and self._inbox.empty():
                    self._wakeup.wait()
                    self._wakeup.clear()
                with self._lock:
                    if self._closed:
                        return
                    added = self._drain_inbox()
                    outputs, failed = step_or_fail(self.engine)
                    self._counts.left_waiting = len(self.engine.scheduler.waiting)
                    self._counts.free_slots = (self.max_num_seqs
                                               - len(self.engine.scheduler.running))
                    self._counts.num_drained += added
                    self._published = self.engine.snapshot()
                self._deliver(outputs, failed)
        except BaseException as exc:  # noqa: BLE001 - the loop is dead: tell everyone
            log.exception("the engine loop died")
            self._die(exc)


class RequestStream:
    """One request's outputs, as an async iterator. `close()` before the
    end aborts the request (its blocks are freed at the next step)."""

    def __init__(self, engine: EngineClient, request_id: str):
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
        self.engine._forget(self.request_id)

    def close(self) -> None:
        if not self.finished:
            self._end()
            self.engine.abort(self.request_id)
