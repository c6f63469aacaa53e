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
- `step_events()` switches on the engine's step events (the live view:
  common/entrypoints/live_view.py); their subscribers run on the loop thread.

Left out: a separate engine process (vLLM v1's EngineCore over ZeroMQ).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable

from common.engine.llm_engine import LLMEngine
from common.engine.step_events import StepEvents
from common.engine.tp_workers import RankDiedError
from common.outputs import FinishReason, RequestOutput
from common.sampling_params import SamplingParams, StructuredOutputsParams

log = logging.getLogger("llm-course")


class EngineDeadError(RuntimeError):
    """The engine loop is not running: nothing will be generated."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine; the others go on."""


class AsyncLLM:
    """A background thread drives `engine.step()`; each request is an async
    stream. Only that thread touches the engine."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.max_num_seqs = engine.scheduler.max_num_seqs
        self.cache_config_info = engine.cache_config_info()  # static: vllm:cache_config_info
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wakeup = threading.Event()
        self._lock = threading.Lock()  # held during a step; close() waits for it
        self._closed = False  # set by close(): the loop ends before its next step
        self.dead: BaseException | None = None
        self.died = threading.Event()
        # For num_waiting(); each counter has one writer thread.
        self._num_added = 0  # requests put in the inbox (the server's thread)
        self._num_drained = 0  # requests taken out and stepped (the engine thread)
        self._left_waiting = 0  # queued after the last step (the engine thread)
        self._free_slots = self.max_num_seqs  # sequence slots free after the last step
        # The engine's figures after the last step: replaced whole (never
        # changed in place), so readers on other threads need no lock.
        self._published: dict = engine.snapshot()
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
        """Requests that will not run at the next step (with `extra` more
        arrivals): those the last step left waiting, plus new arrivals
        beyond the sequence slots it left free. (An arrival that finds a
        slot but no free block counts from the step after: a step late,
        never wrongly refused.)"""
        arrivals = self._num_added - self._num_drained + extra
        return self._left_waiting + max(0, arrivals - self._free_slots)

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

    def step_events(self) -> StepEvents:
        """The engine's step events (the live view subscribes to them),
        switched on between two steps."""
        with self._lock:
            return self.engine.enable_step_events()

    def snapshot(self) -> dict:
        """The engine's figures as of its last step (no lock, no waiting)."""
        stats = dict(self._published)
        stats["engine_alive"] = self.alive
        stats["engine_error"] = None if self.dead is None else repr(self.dead)
        return stats

    # ------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None
                    ) -> "RequestStream":
        """Queue a validated request for the engine loop now; read its
        outputs from the returned stream. `arrival_time` (`time.monotonic()`):
        now unless given (a server may pass when the HTTP request came in)."""
        if arrival_time is None:
            arrival_time = time.monotonic()
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        stream = RequestStream(self, request_id)
        self._streams[request_id] = (asyncio.get_running_loop(), stream.queue)
        self._num_added += 1
        self._inbox.put(("add", request_id, (prompt_token_ids, params, arrival_time)))
        self._wakeup.set()
        return stream

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs; the last has finished=True.
        Closing the iterator early (client gone) aborts the request."""
        stream = self.add_request(request_id, prompt_token_ids, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))
        self._wakeup.set()

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # ------------------------------------------------------------ the loop
    def _send(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, q = stream
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # its event loop is closed: the server has stopped
                pass

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
                    outputs = self._step()
                    self._left_waiting = len(self.engine.scheduler.waiting)
                    self._free_slots = self.max_num_seqs - len(self.engine.scheduler.running)
                    self._num_drained += added
                    self._published = self.engine.snapshot()
                for output in outputs:
                    completion = output.outputs[0]
                    if completion.finish_reason is FinishReason.ERROR:
                        self._send(output.request_id, RequestFailedError(completion.error))
                    else:
                        self._send(output.request_id, output)
        except BaseException as exc:  # noqa: BLE001 - the loop is dead: tell everyone
            log.exception("the engine loop died")
            self.dead = exc
            self.died.set()
            for request_id in list(self._streams):
                self._send(request_id, EngineDeadError(f"the engine loop died: {exc!r}"))

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except RankDiedError:  # ch08: no step can run any more: the loop dies
            raise
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
            log.exception("engine step failed; aborting the requests in flight")
            for request_id in list(self.engine.sequences):
                self.engine.abort(request_id)
                self._send(request_id, RequestFailedError(f"internal engine error: {exc!r}"))
            return []


class RequestStream:
    """One request's outputs, as an async iterator. `close()` before the
    end aborts the request (its blocks are freed at the next step)."""

    def __init__(self, engine: AsyncLLM, request_id: str):
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
