"""AsyncMPClient (vLLM v1's name): the API server's side of engines in their own processes (ch09).

    engine = AsyncMPClient.start(EngineCoreSpec(config), data_parallel_size=2)
    stream = engine.add_request("req-1", prompt_ids, params)   # as with AsyncLLM

The same front as chapters 03-08's `AsyncLLM` (common/engine/async_llm.py:
`EngineClient`), so every server runs on it unchanged; the engine itself
runs in `data_parallel_size` processes (common/engine/core.py), each with
the whole model and its own KV cache, pinned to its share of the cores:

- `start` spawns them, waits for each one's READY (its admission rules
  and sizes: `check_request` and `default_max_tokens` are answered here,
  without a round trip) or FAILED (a flag that does not fit the model:
  raised, as `AsyncLLM.build` raises it);
- `add_request` picks the engine with the fewest unfinished requests
  (vLLM's data-parallel client balances on the engines' queues too) and
  sends it the request; `abort` goes to the same engine;
- a reader thread takes every engine's outputs off one socket: token ids,
  logprobs and finish reasons, which this side's `OutputProcessor` turns
  into text (detokenizing, stop strings held back and cut: the work that
  vLLM v1 also keeps out of its engine process; a stop string matched
  here finishes the request in the engine) and hands to the requests'
  streams; each step's `IterationStats` go to the stat loggers here
  (chapter 06's Prometheus `Metrics` lives in the API server), and the
  engine's figures, at most every 100 ms, to `snapshot()`;
- an engine that dies (a DEAD message, or its process simply gone:
  SIGKILL, out of memory) makes the whole client dead, as in vLLM: every
  stream in flight gets `EngineDeadError` (the server answers 503 and
  exits 1), nothing hangs;
- `close` asks each engine to shut down, then kills what is left.

With `data_parallel_size > 1`, `snapshot()` adds the engines' figures up
(`combine_snapshots`) and lists each under "engines".

With `EngineCoreSpec(watched=True)` (`--live-view`), each engine sends
its step frames with its outputs, and `watch()` gives the live view one
`WatchedEngine` per process: the page shows each engine (`/ui/?engine=1`).

Left out: engines on other
machines (vLLM's `--data-parallel-address`; chapter 09 puts whole servers
on other machines behind its router instead), restarting a dead engine.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace

import zmq

from common.config import ConfigError
from common.context_length import DEFAULT_MAX_TOKENS
from common.core.sequence import Sequence
from common.engine.admission import Admission
from common.engine.async_llm import EngineClient, EngineDeadError, QueueCounts, WatchedEngine
from common.engine.core import (
    EngineCoreOutputType,
    EngineCoreRequestType,
    EngineCoreSpec,
    run_engine_core,
)
from common.engine.output_processor import OutputProcessor
from common.engine.serial import decode, encode
from common.loader import load_tokenizer
from common.metrics.stats import StatLoggers
from common.metrics.step_events import Subscriber
from common.outputs import FinishReason, RequestOutput
from common.sampling_params import SamplingParams, StructuredOutputsParams

log = logging.getLogger("llm-course")

POLL_MS = 100  # the reader checks this often that every engine process is alive
STARTUP_TIMEOUT_S = 900.0
SHUTDOWN_TIMEOUT_S = 10.0


@dataclass
class EngineCoreHandle:
    """The client's view of one engine process."""
    index: int
    process: multiprocessing.Process
    input_socket: zmq.Socket
    counts: QueueCounts = field(default_factory=lambda: QueueCounts(free_slots=0))
    snapshot: dict = field(default_factory=dict)
    unfinished: set[str] = field(default_factory=set)  # request ids sent, not yet finished
    description: dict = field(default_factory=dict)  # LLMEngine.describe(), sent with READY
    frame_subscribers: list[Subscriber] = field(default_factory=list)  # the live view's


def split_cores(data_parallel_size: int) -> list[list[int] | None]:
    """Each engine's cores: this process's cores split evenly, or no
    pinning (None) for one engine or fewer cores than engines."""
    cores = sorted(os.sched_getaffinity(0))
    if data_parallel_size == 1 or len(cores) < data_parallel_size:
        return [None] * data_parallel_size
    share = len(cores) // data_parallel_size
    return [cores[i * share:(i + 1) * share] for i in range(data_parallel_size)]


SAME_IN_EVERY_ENGINE = {"block_size", "bounds", "card", "max_loras"}  # kept as the first engine has them


def combine_snapshots(snapshots: list[dict]) -> dict:
    """Several engines' figures as one: counts added up (lists of counts
    item by item), percentages averaged, the hit rate recomputed."""
    def merge(key: str, values: list):
        first = values[0]
        if key in SAME_IN_EVERY_ENGINE or isinstance(first, (bool, str)) or first is None:
            return first
        if isinstance(first, dict):  # every engine's keys, in order of appearance
            keys = dict.fromkeys(k for v in values for k in v)
            return {k: merge(k, [v.get(k, 0) for v in values]) for k in keys}
        if isinstance(first, list):
            return [sum(items) for items in zip(*values)]
        total = sum(values)
        return total / len(values) if key.endswith("_perc") else total

    combined = {key: merge(key, [s[key] for s in snapshots if key in s]) for key in snapshots[0]}
    if "prefix_cache_hit_rate" in combined:
        queried = combined["prefix_cache_queried_blocks"]
        combined["prefix_cache_hit_rate"] = (combined["prefix_cache_hit_blocks"] / queried
                                             if queried else 0.0)
    return combined



def apply_engine_output(mirror: Sequence, engine_output: RequestOutput) -> None:
    """Bring this side's copy of a request up to the engine's: its new
    tokens (with their logprobs), its finish reason and error, its cached
    prompt tokens, and the prompt's logprobs when they come."""
    completion = engine_output.outputs[0]
    for sampled in completion.logprobs:  # one SampledToken per new token
        mirror.append(sampled)
    mirror.finish_reason, mirror.error = completion.finish_reason, completion.error
    mirror.num_cached_tokens = engine_output.num_cached_tokens
    if engine_output.prompt_logprobs is not None:
        mirror.prompt_logprobs = engine_output.prompt_logprobs

class AsyncMPClient(EngineClient):
    """Engines in processes of their own, behind `EngineClient`'s front."""

    def __init__(self, spec: EngineCoreSpec, data_parallel_size: int = 1):
        super().__init__()
        self.spec = spec
        self.data_parallel_size = data_parallel_size
        self.tokenizer = load_tokenizer(spec.config.model)
        self._context = zmq.Context()
        self._socket_dir = tempfile.mkdtemp(prefix="llm-course-engine-")
        self._output_socket = self._context.socket(zmq.PULL)
        self._output_socket.bind(f"ipc://{self._socket_dir}/output")
        self._send_lock = threading.Lock()  # zmq sockets are not thread-safe
        self._closing = False
        self._stat_loggers = StatLoggers()  # ch06: fed each engine's steps here
        self._engine_of: dict[str, EngineCoreHandle] = {}  # request id -> its engine
        # The text side, here as in vLLM v1's front: a copy of each request
        # (its tokens so far), detokenized and searched for stop strings
        self._output_processor = OutputProcessor(self.tokenizer)
        self._mirrors: dict[str, Sequence] = {}
        self._output_lock = threading.Lock()  # the event loop adds, the reader processes
        self.engines = [self._spawn(i, cpus)
                        for i, cpus in enumerate(split_cores(data_parallel_size))]
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, spec: EngineCoreSpec, data_parallel_size: int = 1,
              timeout_s: float = STARTUP_TIMEOUT_S) -> "AsyncMPClient":
        """Spawn the engines and wait until each is READY (or raise why not)."""
        client = cls(spec, data_parallel_size)
        try:
            client._wait_ready(timeout_s)
        except BaseException:
            client.close()
            raise
        client._thread = threading.Thread(target=client._read_outputs, name="engine-outputs",
                                          daemon=True)
        client._thread.start()
        return client

    def _spawn(self, index: int, cpus: list[int] | None) -> EngineCoreHandle:
        input_address = f"ipc://{self._socket_dir}/input-{index}"
        input_socket = self._context.socket(zmq.PUSH)
        input_socket.bind(input_address)
        # spawn, not fork: this process may already run threads (and torch's pool)
        process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name=f"engine-core-{index}",
            args=(replace(self.spec, cpus=cpus), index, input_address,
                  f"ipc://{self._socket_dir}/output"))
        process.start()
        log.info("engine core %d: pid %d, cores %s", index, process.pid, cpus or "all")
        return EngineCoreHandle(index, process, input_socket)

    def _wait_ready(self, timeout_s: float) -> None:
        waiting = {engine.index for engine in self.engines}
        waited_ms = 0
        while waiting:
            if not self._output_socket.poll(POLL_MS):
                waited_ms += POLL_MS
                gone = [e for e in self.engines if e.index in waiting and not e.process.is_alive()]
                if gone:
                    raise RuntimeError(f"engine core {gone[0].index} exited with status "
                                       f"{gone[0].process.exitcode} before it was ready")
                if waited_ms > timeout_s * 1000:
                    raise TimeoutError(f"the engines were not ready within {timeout_s:g} s")
                continue
            message = decode(self._output_socket.recv())
            if message["type"] == EngineCoreOutputType.FAILED:
                error_type = ConfigError if message["error_type"] == "ConfigError" else RuntimeError
                raise error_type(message["error"])
            if message["type"] == EngineCoreOutputType.READY:
                self._on_ready(self.engines[message["engine"]], message)
                waiting.discard(message["engine"])

    def _on_ready(self, engine: EngineCoreHandle, ready: dict) -> None:
        self.admission: Admission = ready["admission"]
        self.max_model_len = self.admission.max_model_len
        self.vocab_size = ready["vocab_size"]
        self.max_num_seqs = ready["max_num_seqs"]
        self.cache_config_info = ready["cache_config_info"]
        engine.counts.free_slots = ready["max_num_seqs"]
        engine.snapshot = ready["snapshot"]
        engine.description = ready["description"]
        self._publish()
        self.structured_output = None  # ch07: compiled here too, to answer 400 at once
        if self.spec.parts.structured_output_cls is not None:
            spec = self.spec.config.speculative_config
            self.structured_output = self.spec.parts.structured_output_cls(
                self.tokenizer, ready["model_vocab_size"], ready["eos_token_ids"],
                spec.num_speculative_tokens if spec else 0)

    # ------------------------------------------------------ what servers ask
    @property
    def alive(self) -> bool:
        return (self.dead is None and self._thread is not None and self._thread.is_alive())

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """The engines' admission rules, checked here (they are all alike)."""
        if params.structured_outputs is not None and num_prompt_tokens:
            self.compile_grammar(params.structured_outputs)
        self.admission.check(num_prompt_tokens, params)

    def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """ch07: compiled here to refuse a bad grammar at once; each engine
        compiles it again when the request arrives (xgrammar caches it)."""
        if self.structured_output is None:
            raise ValueError("Structured outputs need an engine built with a "
                             "StructuredOutputManager (chapter 07).")
        self.structured_output.compile(params)

    def default_max_tokens(self, num_prompt_tokens: int,
                           cap: int | None = DEFAULT_MAX_TOKENS) -> int:
        return self.admission.default_max_tokens(num_prompt_tokens, cap)

    def num_waiting(self, extra: int = 0) -> int:
        """`QueueCounts.num_waiting` over all engines; `extra` arrivals
        first fill the slots left free anywhere."""
        counts = [engine.counts for engine in self.engines]
        spare = sum(max(0, c.free_slots - (c.num_added - c.num_drained)) for c in counts)
        return sum(c.num_waiting() for c in counts) + max(0, extra - spare)

    def add_stat_logger(self, logger) -> None:
        """ch06: `logger.record(iteration_stats)` for every engine's every
        step, called on the reader thread."""
        self._stat_loggers.add(logger)

    def watch(self) -> list[WatchedEngine]:
        """Each engine process, for the live view: its frames come with its
        outputs (`EngineCoreSpec(watched=True)`), and the reader thread
        hands them to the subscribers."""
        if not self.spec.watched:
            raise RuntimeError("The engines send their step frames only when started "
                               "with EngineCoreSpec(watched=True) (--live-view).")
        return [WatchedEngine(engine.description, engine.frame_subscribers.append)
                for engine in self.engines]

    def close(self) -> None:
        """Ask every engine to stop, wait for them, kill what is left."""
        if self._closing:
            return
        self._closing = True
        for engine in self.engines:
            with contextlib.suppress(EngineDeadError):  # an engine already gone
                self._send_to(engine, [int(EngineCoreRequestType.SHUTDOWN)])
        for engine in self.engines:
            engine.process.join(SHUTDOWN_TIMEOUT_S)
            if engine.process.is_alive():
                log.warning("engine core %d did not stop: killing it", engine.index)
                engine.process.kill()
                engine.process.join()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join()
        for engine in self.engines:
            engine.input_socket.close(linger=0)
        self._output_socket.close(linger=0)
        self._context.term()
        shutil.rmtree(self._socket_dir, ignore_errors=True)

    # ------------------------------------------------------------ requests
    def _send_to(self, engine: EngineCoreHandle, message: list) -> None:
        """Never blocks: a PUSH socket whose engine is gone would wait for
        it for good, and the server's event loop with it."""
        try:
            with self._send_lock:
                engine.input_socket.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            raise EngineDeadError(f"engine core {engine.index} does not take requests") from None

    def _submit_add(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float, lora_request=None) -> None:
        engine = min(self.engines, key=lambda e: (len(e.unfinished), e.counts.num_added))
        engine.unfinished.add(request_id)
        engine.counts.num_added += 1
        self._engine_of[request_id] = engine
        with self._output_lock:  # this side's copy of the request, for its text
            mirror = Sequence(request_id, list(prompt_token_ids), params,
                              arrival_time=arrival_time)
            self._mirrors[request_id] = mirror
            self._output_processor.add(mirror)
        lora = None if lora_request is None else [  # ch10: the adapter, as plain values
            lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path]
        self._send_to(engine, [int(EngineCoreRequestType.ADD), request_id, prompt_token_ids,
                               params, arrival_time, lora])

    def _submit_abort(self, request_id: str) -> None:
        self._forget_mirror(request_id)
        engine = self._engine_of.get(request_id)
        if engine is not None and not self._closing:
            self._send_to(engine, [int(EngineCoreRequestType.ABORT), request_id])

    def _finished(self, request_id: str) -> None:
        engine = self._engine_of.pop(request_id, None)
        if engine is not None:
            engine.unfinished.discard(request_id)

    def _forget_mirror(self, request_id: str) -> None:
        with self._output_lock:
            self._mirrors.pop(request_id, None)
            self._output_processor.abort(request_id)

    # ------------------------------------------------- token ids -> text
    def _process(self, engine: EngineCoreHandle, engine_outputs: list[RequestOutput]
                 ) -> list[RequestOutput]:
        """What the engine sent (token ids, finish reasons, logprobs) as the
        requests' outputs: text, stop strings held back and cut, deltas or
        final answers, by the same `OutputProcessor` as chapters 03-08's
        engine, run here. A stop string matched here finishes the request
        in the engine too (ABORT with STOP); tokens the engine made before
        that arrives are dropped, as a client never sees them."""
        outputs = []
        with self._output_lock:
            for engine_output in engine_outputs:
                mirror = self._mirrors.get(engine_output.request_id)
                if mirror is None:  # finished here already, or aborted
                    continue
                apply_engine_output(mirror, engine_output)
                processed, to_finish = self._output_processor.process([mirror])
                for finish in to_finish:
                    self._finish_in_engine(engine, finish.seq.request_id, finish.reason)
                for output in processed:
                    if output.finished:
                        del self._mirrors[output.request_id]
                        self._finished(output.request_id)
                outputs += processed
        return outputs

    def _finish_in_engine(self, engine: EngineCoreHandle, request_id: str,
                          reason: FinishReason) -> None:
        if not self._closing:
            with contextlib.suppress(EngineDeadError):  # then the reader dies on its own
                self._send_to(engine, [int(EngineCoreRequestType.ABORT), request_id, reason])

    # ---------------------------------------------------- the reader thread
    def _read_outputs(self) -> None:
        """Every engine's messages; every POLL_MS, busy or not, a check that
        each engine process is alive (while one engine streams, a dead
        one must not wait for a quiet moment to be noticed)."""
        try:
            checked = time.monotonic()
            while not self._closing:
                if self._output_socket.poll(POLL_MS):
                    self._on_message(decode(self._output_socket.recv()))
                if not self._closing and time.monotonic() - checked >= POLL_MS / 1000:
                    self._check_processes()
                    checked = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - the front cannot go on: say so
            log.exception("the engine client's reader died")
            self._die(exc)

    def _check_processes(self) -> None:
        for engine in self.engines:
            if not engine.process.is_alive():
                raise EngineDeadError(f"engine core {engine.index} (pid {engine.process.pid}) "
                                      f"exited with status {engine.process.exitcode}")

    def _on_message(self, message: dict) -> None:
        engine = self.engines[message["engine"]]
        if message["type"] == EngineCoreOutputType.DEAD:
            raise EngineDeadError(f"engine core {engine.index} died: {message['error']}")
        if message["type"] != EngineCoreOutputType.OUTPUTS:
            return
        counts = engine.counts
        counts.num_drained += message["num_drained"]
        counts.left_waiting = message["left_waiting"]
        counts.free_slots = message["free_slots"]
        if "snapshot" in message:  # at most every 100 ms, and when the engine is idle
            engine.snapshot = message["snapshot"]
            self._publish()
        for iteration_stats in message["iteration_stats"]:
            self._stat_loggers.record(iteration_stats)
        for frame in message.get("frames", ()):  # the live view, when it watches
            for subscriber in engine.frame_subscribers:
                try:
                    subscriber(frame)
                except Exception:  # noqa: BLE001 - a viewer's problem, never the engines'
                    log.exception("step frame subscriber %r failed", subscriber)
        for request_id, _ in message["failed"]:
            self._finished(request_id)
            self._forget_mirror(request_id)
        self._deliver(self._process(engine, message["outputs"]), message["failed"])

    def _publish(self) -> None:
        snapshots = [engine.snapshot for engine in self.engines if engine.snapshot]
        if len(self.engines) == 1:
            self._published = snapshots[0]
        elif snapshots:
            self._published = {**combine_snapshots(snapshots),
                               "data_parallel_size": self.data_parallel_size,
                               "engines": snapshots}
