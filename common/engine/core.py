"""EngineCoreProc (vLLM v1's name): the engine in a process of its own (ch09).

The API server's process tokenizes, checks, streams and answers; this
process only schedules and steps. They talk over two ZeroMQ sockets, in
msgpack (common/engine/serial.py):

    API server  --PUSH-->  input  --PULL-->   engine core   [ADD, id, ids, params, t]
                                                            [ABORT, id(, reason)]  [SHUTDOWN]
    API server  <--PULL--  output <--PUSH--   engine core   EngineCoreOutputs, one a step

Where vLLM v1 draws the line: this process returns token ids, finish
reasons and logprobs (`TokenOutputProcessor`); the API server's process
detokenizes, holds back and cuts the stop strings, and formats the
logprobs, and when it matches a stop string it sends [ABORT, id, STOP].

The loop, one step at a time (`EngineCoreProc.run_busy_loop`):

    take in every request and abort that arrived (wait for one when idle)
    outputs, failed = step_or_fail(engine)   # the same step as ch03-08's thread
    send EngineCoreOutputs: the outputs, the failures, the step's stats,
        its queue counts (backpressure), the engine's figures (`/stats`)
        at most every 100 ms and whenever it goes idle, and, when the
        live view watches (`--live-view`), the step's frame

Being a process of its own is the point: however long a step takes (a
7,000-token prefill), the API server's event loop is not in the same
interpreter, so `/health` and a bad request's 400 answer at once. A
Python thread (ch03-08) shares the interpreter's lock with the server.

What is sent first: READY with what the front needs to know once (the
admission rules, the sizes), or FAILED with the error if the engine could
not be built (a flag that does not fit the model). If the loop dies, DEAD
with the error, then the process exits 1. If it is killed, nothing is
sent: the client notices the process is gone (core_client.py). If the
API server is killed, a watcher thread ends this process within a second,
whatever its loop is doing (`exit_with_parent`).

`cpus` pins the process to some cores and sizes torch's thread pool to
them (data parallel, `--data-parallel-size 2` on 2 cores: a core each).

Left out: vLLM's handshake socket and its coordinator for data-parallel
waves, the output thread that overlaps sending with the next step,
`--api-server-count` (several API server processes).
"""
from __future__ import annotations

import enum
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import NoReturn

import torch
import zmq

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine, step_or_fail
from common.engine.output_processor import OutputProcessor, RequestState, request_output
from common.engine.parts import EngineParts, assemble_engine
from common.engine.serial import decode, encode
from common.outputs import FinishReason, RequestOutput

log = logging.getLogger("llm-course")

IDLE_POLL_MS = 1000  # an idle engine wakes this often (to see a SHUTDOWN it missed)
PARENT_POLL_S = 0.5  # the watcher checks this often that the API server is alive
# The engine's figures (`/stats`, the live view) cross at most this often,
# and once more when the engine goes idle: building them every step is
# work the busy loop does not need.
SNAPSHOT_INTERVAL_S = 0.1


class EngineCoreRequestType(enum.IntEnum):
    """The first item of every message to the engine (vLLM's name)."""
    ADD = 0
    ABORT = 1
    SHUTDOWN = 2


class EngineCoreOutputType(enum.IntEnum):
    """What a message from the engine carries (its "type" key)."""
    READY = 0  # the engine is built: its admission rules and sizes
    FAILED = 1  # the engine could not be built: the error
    OUTPUTS = 2  # one step's outputs, failures, stats and figures
    DEAD = 3  # the loop died: the error; the process exits next


@dataclass
class EngineCoreSpec:
    """What a process needs to build its engine: the flags and the
    chapter's parts, both picklable (the process is spawned)."""
    config: EngineConfig
    parts: EngineParts = field(default_factory=EngineParts)
    cpus: list[int] | None = None  # pin to these cores (None: all of them)
    watched: bool = False  # the live view: each step's frame goes to the API server

    def build(self, index: int) -> LLMEngine:
        """The chapter's parts, with token ids out instead of text: the API
        process detokenizes (vLLM v1 draws the line there too)."""
        return assemble_engine(self.config,
                               replace(self.parts, output_processor_cls=TokenOutputProcessor),
                               data_parallel_rank=index)


class TokenOutputProcessor(OutputProcessor):
    """The engine process's output processing: each step's new token ids
    and their logprobs, the finish reasons the engine knows (EOS, stop
    token ids, length, errors) and the prompt's logprobs in the first
    output, always as deltas. No text and no stop strings: the API
    process's `OutputProcessor` makes the text from these ids and looks
    for the stop strings (core_client.py), then tells this process to
    finish the request (ABORT with STOP)."""

    def add(self, seq) -> None:
        self.states[seq.request_id] = RequestState(seq, detokenizer=None)

    def _new_texts(self, state: RequestState, finishing: bool) -> tuple[str, bool]:
        return "", False

    @staticmethod
    def _output(state: RequestState, new_text: str, num_new: int, reason: FinishReason | None,
                error: str | None) -> RequestOutput:
        seq = state.seq  # no text, and not the prompt again: the API side has it
        return request_output(seq, "", seq.num_output_tokens - num_new, reason, error, [])


class StepStatsBuffer:
    """A stat logger inside the engine process: keeps each step's
    `IterationStats` until they are sent to the front, which records them."""

    def __init__(self) -> None:
        self.pending: list = []

    def record(self, iteration_stats) -> None:
        self.pending.append(iteration_stats)

    def take(self) -> list:
        taken, self.pending = self.pending, []
        return taken


class EngineCoreProc:
    """The engine's loop in its own process; `run_engine_core` starts it."""

    def __init__(self, engine: LLMEngine, index: int, input_socket: zmq.Socket,
                 output_socket: zmq.Socket, watched: bool = False):
        self.engine = engine
        self.index = index  # which data-parallel engine this is
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.stats_buffer = StepStatsBuffer()
        engine.add_stat_logger(self.stats_buffer)
        self.frames: list[dict] = []  # the live view's step frames, not yet sent
        if watched:
            engine.enable_step_events().subscribe(self.frames.append)
        self.shutting_down = False
        self.failed: list[tuple[str, str]] = []  # requests refused on arrival
        self.num_added = 0  # requests taken in since the last message
        self.snapshot_sent_at = 0.0  # time.monotonic() of the last figures sent

    def ready_message(self) -> dict:
        engine = self.engine
        return {"type": int(EngineCoreOutputType.READY), "engine": self.index,
                "admission": engine.admission, "vocab_size": engine.vocab_size,
                "max_num_seqs": engine.scheduler.max_num_seqs,
                "cache_config_info": engine.cache_config_info(),
                "model_vocab_size": engine.loaded.model.config.vocab_size,
                "eos_token_ids": sorted(engine.eos_token_ids),
                "description": engine.describe(),  # the live view's config
                "snapshot": engine.snapshot()}

    def run_busy_loop(self) -> None:
        self.output_socket.send(encode(self.ready_message()))
        while not self.shutting_down:
            received = self.receive(wait=not self.engine.has_unfinished_requests())
            if self.shutting_down:
                return
            outputs, failed = step_or_fail(self.engine)
            failed, self.failed = self.failed + failed, []
            if received or outputs or failed or self.stats_buffer.pending or self.frames:
                self.send_outputs(outputs, failed)  # an abort alone changes the figures

    def receive(self, wait: bool) -> int:
        """Take in what arrived (waiting for a first message when idle);
        returns how many messages."""
        received = 0
        while not self.shutting_down:
            if not self.input_socket.poll(IDLE_POLL_MS if wait else 0):
                if not wait:
                    return received
                continue
            wait = False  # something came: take what else is there, then step
            self.handle(decode(self.input_socket.recv()))
            received += 1
        return received

    def handle(self, message: list) -> None:
        kind = EngineCoreRequestType(message[0])
        if kind is EngineCoreRequestType.ADD:
            _, request_id, prompt_token_ids, params, arrival_time, lora = message
            self.num_added += 1
            try:
                self.engine.add_request(request_id, prompt_token_ids, params, arrival_time,
                                        lora_request=lora)  # ch10: [name, id, path] or None
            except ValueError as exc:  # a duplicate request id
                self.failed.append((request_id, str(exc)))
        elif kind is EngineCoreRequestType.ABORT:  # [ABORT, id] or [ABORT, id, reason]
            _, request_id, *reason = message
            self.engine.abort(request_id, *reason)  # STOP: a stop string the front matched
        else:
            self.shutting_down = True

    def send_outputs(self, outputs: list, failed: list) -> None:
        scheduler = self.engine.scheduler
        added, self.num_added = self.num_added, 0
        message = {
            "type": int(EngineCoreOutputType.OUTPUTS), "engine": self.index,
            "outputs": outputs, "failed": failed,
            "iteration_stats": self.stats_buffer.take(),
            "num_drained": added, "left_waiting": len(scheduler.waiting),
            "free_slots": scheduler.max_num_seqs - len(scheduler.running)}
        if self.frames:  # the live view: every step's frame, as they came
            message["frames"] = self.frames.copy()
            self.frames.clear()  # the same list: the step events append to it
        now = time.monotonic()
        idle = not self.engine.has_unfinished_requests()
        if idle or now - self.snapshot_sent_at >= SNAPSHOT_INTERVAL_S:
            message["snapshot"] = self.engine.snapshot()  # /stats: at most every 100 ms
            self.snapshot_sent_at = now
        self.output_socket.send(encode(message))


def exit_with_parent(index: int) -> None:
    """A daemon thread that ends this process as soon as its API server is
    gone (its parent pid changes), whatever the loop is doing: computing a
    step, or blocked sending to a socket nobody reads any more. No orphan
    keeps a core or its memory. `os._exit`: the loop cannot be asked."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        log.error("engine core %d: the API server died; exiting", index)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def pin_to(cpus: list[int] | None) -> None:
    """Run on `cpus` only, with one torch thread each."""
    if cpus:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))


def send_last_and_exit(output_socket: zmq.Socket, message: dict) -> NoReturn:
    """The process's last word to the front (FAILED or DEAD), then exit 1."""
    output_socket.send(encode(message))
    output_socket.close(linger=1000)
    sys.exit(1)


def run_engine_core(spec: EngineCoreSpec, index: int, input_address: str,
                    output_address: str) -> None:
    """The engine process's main (multiprocessing's target)."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s [engine {index}] %(message)s")
    exit_with_parent(index)
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    input_socket.connect(input_address)
    output_socket = context.socket(zmq.PUSH)
    output_socket.connect(output_address)
    try:
        pin_to(spec.cpus)
        engine = spec.build(index)
    except Exception as exc:  # noqa: BLE001 - told to the front, which raises it
        send_last_and_exit(output_socket, {"type": int(EngineCoreOutputType.FAILED),
                                           "engine": index, "error": str(exc),
                                           "error_type": type(exc).__name__})
    core = EngineCoreProc(engine, index, input_socket, output_socket, spec.watched)
    try:
        core.run_busy_loop()
    except BaseException as exc:  # noqa: BLE001 - tell the front, then exit 1
        log.exception("engine core %d died", index)
        send_last_and_exit(output_socket, {"type": int(EngineCoreOutputType.DEAD),
                                           "engine": index, "error": repr(exc)})
    finally:
        engine.close()  # ch08: the tensor-parallel ranks
    output_socket.close(linger=1000)
    input_socket.close(linger=0)
    context.term()
