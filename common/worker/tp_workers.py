"""The ranks of tensor parallelism: the processes and the pipes (ch08).

Rank 0 is the engine's own process: it schedules, samples and processes
outputs, once. Ranks 1..N-1 are worker processes (torch.multiprocessing,
spawn) started by `start_ranks`. Every rank, rank 0 included, is built by
the same `build_worker` (common/worker/worker.py): it joins the process
group (gloo on the CPU, NCCL on CUDA; the rendezvous is a free TCP port on
localhost), loads the model and keeps its shard (common/layers/parallel.py),
books it on a card of its own (the same `--device-memory-gb`), agrees with
the others on the number of KV blocks (the smallest) and allocates its KV
heads' share of the cache. This module is the transport around it:

1. `start_ranks` spawns ranks 1..N-1 (`worker.worker_main`);
2. `TPWorkers.build_rank0` builds rank 0 beside them, then waits for every
   rank's `RankReport` and logs the startup line (`describe_ranks`);
3. `TPWorkers.execute` sends each step's `StepInputs` to the workers, which
   run the forward pass (taking part in its all-reduces) and the LM head
   (their slices of the logits go to rank 0), until `shutdown` says "stop".

The step's inputs travel over a pipe per worker, as plain lists: like
vLLM's message queue, not a collective, so that a worker can wait for the
next request as long as the server stays idle, while every collective of
the forward pass fails after `parallel.TIMEOUT_S`.

A rank that dies (or a collective that fails) leaves the others out of
step for good, so it is fatal: `RankDiedError`, which stops the engine
loop (the server answers 503 `engine_dead` and exits 1).

Left out: restarting a rank, several nodes, overlapping the broadcast
with the previous step.
"""
from __future__ import annotations

import atexit
import logging
import time
from typing import Callable

import torch
import torch.multiprocessing as mp

from common.config import ConfigError, EngineConfig
from common.worker.model_runner import StepInputs
from common.worker.worker import (STOP, RankDiedError, RankReport, Worker, WorkerFailed,
                                  rank_device, worker_main)
from common.layers.parallel import destroy_tensor_parallel
from common.memory import format_bytes
from common.net import free_port

log = logging.getLogger("llm-course")
READY_TIMEOUT_S = 600.0  # loading the model on every rank (a hang guard)


# ------------------------------------------------------- rank 0's side
class TPWorkers:
    """Rank 0's handle on ranks 1..N-1: send each step, watch them, stop them."""

    def __init__(self, processes: list, conns: list, port: int):
        self.processes = processes  # processes[i] is rank i + 1
        self.conns = conns
        self.port = port  # the ranks' rendezvous, for rank 0 to join
        self.closed = False
        self.errors: list[str] = []  # what workers reported before dying
        self.reports: list[RankReport] = []  # every rank's share, once all are ready
        self._threads = torch.get_num_threads()
        atexit.register(self.shutdown)

    def execute(self, step: StepInputs, forward_logits) -> torch.Tensor | None:
        """Send the step to every worker, run rank 0's part. Any failure
        is fatal: the ranks would be out of step."""
        try:
            self.check_alive()
            for conn in self.conns:
                conn.send(step)
            return forward_logits(step)
        except RankDiedError:
            raise
        except Exception as exc:  # noqa: BLE001 - turned into the fatal error
            raise self.failure(exc) from exc

    def check_alive(self) -> None:
        dead = self._dead()
        if dead:
            raise RankDiedError(self._describe(dead))

    def build_rank0(self, build: Callable[..., Worker]) -> Worker:
        """Build rank 0 (`build(port=, workers=)`, common/worker/worker.py)
        beside the workers, wait for every rank's report and log the startup
        line. A failure stops every rank; a worker that died (or a collective
        that failed) while starting is a RankDiedError."""
        try:
            worker = build(port=self.port, workers=self)
            log.info(self.wait_ready(worker.report, worker.kv_cache.block_size))
            return worker
        except (RankDiedError, ConfigError, torch.OutOfMemoryError):  # said clearly already
            self.shutdown()
            raise
        except Exception as exc:  # noqa: BLE001 - a worker that died while starting
            error = self.failure(exc)
            self.shutdown()
            raise error from exc

    def wait_ready(self, rank0: RankReport, block_size: int) -> str:
        """Wait for every worker's report (its cache is allocated); returns
        the startup line."""
        self.reports = [rank0] + [self._receive_report(conn) for conn in self.conns]
        return describe_ranks(self.reports, block_size)

    def _receive_report(self, conn) -> RankReport:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not conn.poll(0.1):
            self.check_alive()
            if time.monotonic() > deadline:
                raise RankDiedError(f"a tensor-parallel rank did not start in "
                                    f"{READY_TIMEOUT_S:.0f} s")
        try:
            message = conn.recv()
        except EOFError:
            raise self.failure(EOFError("the worker closed its pipe")) from None
        if isinstance(message, WorkerFailed):
            raise RankDiedError(f"tensor-parallel rank {message.rank} failed to start: "
                                f"{message.error}")
        return message

    def failure(self, exc: BaseException) -> RankDiedError:
        """The clear error for a step (or the startup) that failed."""
        deadline = time.monotonic() + 2.0  # a killed process takes a moment to be reaped
        while not self._dead() and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = self._dead()
        cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if dead:
            return RankDiedError(f"{self._describe(dead)} ({cause})")
        return RankDiedError(f"a collective between the tensor-parallel ranks failed: {cause}")

    def _dead(self) -> list[tuple[int, object]]:
        return [(rank, p) for rank, p in enumerate(self.processes, start=1) if not p.is_alive()]

    def _describe(self, dead) -> str:
        for conn in self.conns:  # a worker that failed said why
            try:
                while conn.poll():
                    message = conn.recv()
                    if isinstance(message, WorkerFailed):
                        self.errors.append(f"rank {message.rank}: {message.error}")
            except (EOFError, OSError):
                pass
        ranks = ", ".join(f"rank {rank} (pid {p.pid}, exit code {p.exitcode})"
                          for rank, p in dead)
        said = f"; {'; '.join(self.errors)}" if self.errors else ""
        return (f"tensor-parallel {ranks} died{said}: the engine cannot go on "
                "without it (restart the server)")

    def shutdown(self) -> None:
        """Tell every worker to stop, wait a little, then make sure."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.shutdown)
        for conn in self.conns:
            try:
                conn.send(STOP)
            except OSError:
                pass
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for conn in self.conns:
            conn.close()
        destroy_tensor_parallel()
        torch.set_num_threads(self._threads)


def start_ranks(config: EngineConfig, block_size: int, num_blocks: int | None) -> TPWorkers:
    """Spawn ranks 1..N-1; each loads `config.model` itself and waits for
    rank 0 to join (`TPWorkers.build_rank0`)."""
    world_size = config.tensor_parallel_size
    if rank_device(config.device, 0).type == "cuda" and torch.cuda.device_count() < world_size:
        raise ConfigError(f"--tensor-parallel-size {world_size} needs {world_size} GPUs, "
                          f"{torch.cuda.device_count()} found.")
    if torch.distributed.is_initialized():
        raise ConfigError("one tensor-parallel engine per process: close() the other first.")
    port = free_port()
    ctx = mp.get_context("spawn")
    processes, conns = [], []
    for rank in range(1, world_size):
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=worker_main, name=f"tp-rank-{rank}", daemon=True,
                              args=(config, rank, port, block_size, num_blocks, theirs))
        process.start()
        theirs.close()  # the worker holds its end; ours sees EOF if it dies
        processes.append(process)
        conns.append(ours)
    return TPWorkers(processes, conns, port)


def describe_ranks(reports: list[RankReport], block_size: int) -> str:
    """The startup line: per rank weights and blocks, and the total."""
    per_rank = "; ".join(f"rank {r.rank}: weights {format_bytes(r.weight_bytes)}, "
                         f"room for {r.room_blocks} blocks" for r in reports)
    num_blocks = reports[0].num_blocks
    weights = sum(r.weight_bytes for r in reports)
    kv = sum(r.num_blocks * r.block_bytes for r in reports)
    return (f"tensor parallel, {len(reports)} ranks ({per_rank}); every rank keeps "
            f"{num_blocks} blocks of {block_size} tokens (1/{len(reports)} of the KV heads, "
            f"{format_bytes(reports[0].block_bytes)} a block per rank); total: weights "
            f"{format_bytes(weights)}, KV cache {format_bytes(kv)} for "
            f"{num_blocks * block_size} tokens")
