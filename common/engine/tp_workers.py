"""The ranks of tensor parallelism: one process each (ch06).

Rank 0 is the engine's own process: it schedules, samples and processes
outputs, once. Ranks 1..N-1 are worker processes (torch.multiprocessing,
spawn) started by `start_ranks`. Each worker

1. joins the process group (gloo on the CPU, NCCL on CUDA; the rendezvous
   is a free TCP port on localhost),
2. loads the model itself and keeps its shard (common/layers/parallel.py),
3. books its shard on a card of its own (the same `--device-memory-gb`),
   agrees with the others on the number of KV blocks (the smallest), and
   allocates its KV heads' share of the cache,
4. loops: receive the step's `StepInputs` from rank 0, run the forward pass
   (taking part in its all-reduces) and the LM head (its slice of the
   logits goes to rank 0), until rank 0 says "stop".

The step's inputs travel over a pipe per worker, as plain lists: like
vLLM's message queue, not a collective, so that a worker can wait for the
next request as long as the server stays idle, while every collective of
the forward pass fails after `parallel.TIMEOUT_S`.

A rank that dies (or a collective that fails) leaves the others out of
step for good, so it is fatal: `RankDiedError`, which stops the engine
loop (the server answers 503 `engine_dead` and exits 1).

Left out: restarting a rank, several nodes, overlapping the broadcast
with the previous step, a rank per GPU chosen by the user (rank r takes
cuda:r).
"""
from __future__ import annotations

import atexit
import os
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from common.config import ConfigError, EngineConfig
from common.engine.kv_cache import KVCache, num_blocks_for_card
from common.engine.model_runner import ModelRunner, StepInputs
from common.layers.parallel import (
    TPGroup,
    destroy_tensor_parallel,
    free_port,
    init_tensor_parallel,
)
from common.loader import LoadedModel, load_model, pick_device
from common.memory import Card, format_bytes
from common.models import shard_for_rank

STOP = "stop"
READY_TIMEOUT_S = 600.0  # loading the model on every rank (a hang guard)


class RankDiedError(RuntimeError):
    """A tensor-parallel rank is gone, or a collective between the ranks
    failed: the ranks are out of step and the engine cannot go on."""


@dataclass
class RankReport:
    """What a rank tells rank 0 once its cache is allocated."""
    rank: int
    weight_bytes: int
    room_blocks: int  # blocks its own card could hold
    num_blocks: int  # blocks it allocated (the same on every rank)
    block_bytes: int  # bytes of one block on this rank


@dataclass
class WorkerFailed:
    """Sent by a worker before it exits on an error."""
    rank: int
    error: str


def rank_device(device: str | torch.device, rank: int) -> torch.device:
    """Rank r's card: cuda:r, or the CPU (a simulated card per rank)."""
    device = pick_device(str(device)) if isinstance(device, str) else device
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def threads_per_rank(world_size: int) -> int:
    """On the CPU the ranks share the cores: each gets its part."""
    return max(1, (os.cpu_count() or 1) // world_size)


# ------------------------------------------------------------ the workers
def build_rank(config: EngineConfig, loaded: LoadedModel, tp: TPGroup, block_size: int,
               num_blocks: int | None) -> tuple[Card, KVCache, RankReport]:
    """A worker's share: its card, its weights, its part of every KV block."""
    card = Card(loaded.device, config.device_memory_gb, config.gpu_memory_utilization)
    weight_bytes = card.charge_weights(loaded.model)
    room = num_blocks
    if num_blocks is None:
        room, _ = num_blocks_for_card(card, loaded.model, block_size,
                                      config.max_num_batched_tokens, tp.world_size)
        num_blocks = tp.min_over_ranks(room)  # the same blocks on every card
    kv_cache = KVCache(card, loaded.model.config, num_blocks, block_size, loaded.dtype,
                       tp.world_size)
    block_bytes = KVCache.bytes_per_block(loaded.model.config, block_size, loaded.dtype,
                                          tp.world_size)
    return card, kv_cache, RankReport(tp.rank, weight_bytes, room, num_blocks, block_bytes)


def worker_main(config: EngineConfig, rank: int, port: int, block_size: int,
                num_blocks: int | None, conn) -> None:
    """The body of worker process `rank` (1..N-1)."""
    world_size = config.tensor_parallel_size
    try:
        device = rank_device(config.device, rank)
        if device.type == "cpu":
            torch.set_num_threads(threads_per_rank(world_size))
        tp = init_tensor_parallel(rank, world_size, port, device)
        loaded = load_model(config.model, config.dtype, str(device), config.load_format,
                            config.seed)
        shard_for_rank(loaded.model, rank, world_size)  # keep this rank's share
        _card, kv_cache, report = build_rank(config, loaded, tp, block_size, num_blocks)
        runner = ModelRunner(loaded.model, kv_cache, tp=tp)
        conn.send(report)
        serve_steps(conn, runner)
    except Exception as exc:  # noqa: BLE001 - tell rank 0, then exit non-zero
        traceback.print_exc()
        try:
            conn.send(WorkerFailed(rank, f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        sys.exit(1)
    finally:
        destroy_tensor_parallel()


def serve_steps(conn, runner: ModelRunner) -> None:
    """Run every step rank 0 sends, until "stop" (or rank 0 is gone)."""
    while True:
        try:
            step = conn.recv()
        except EOFError:  # rank 0's end of the pipe closed: it is gone
            return
        if step == STOP:
            return
        runner.execute_model(step)  # all-reduces inside; the logits go to rank 0


# ------------------------------------------------------- rank 0's side
class TPWorkers:
    """Rank 0's handle on ranks 1..N-1: send each step, watch them, stop them."""

    def __init__(self, processes: list, conns: list):
        self.processes = processes  # processes[i] is rank i + 1
        self.conns = conns
        self.closed = False
        self.errors: list[str] = []  # what workers reported before dying
        self.reports: list[RankReport] = []  # every rank's share, once all are ready
        self._threads = torch.get_num_threads()
        atexit.register(self.shutdown)

    def execute(self, step: StepInputs, execute_model) -> torch.Tensor | None:
        """Send the step to every worker, run rank 0's part. Any failure
        is fatal: the ranks would be out of step."""
        try:
            self.check_alive()
            for conn in self.conns:
                conn.send(step)
            return execute_model(step)
        except RankDiedError:
            raise
        except Exception as exc:  # noqa: BLE001 - turned into the fatal error
            raise self.failure(exc) from exc

    def check_alive(self) -> None:
        dead = self._dead()
        if dead:
            raise RankDiedError(self._describe(dead))

    def min_num_blocks(self, tp: TPGroup, room: int) -> int:
        """The number of KV blocks every card can hold: the smallest room."""
        try:
            return tp.min_over_ranks(room)
        except Exception as exc:  # noqa: BLE001 - a worker failed while loading
            error = self.failure(exc)
            self.shutdown()
            raise error from exc

    def wait_ready(self, rank0: RankReport, block_size: int) -> str:
        """Wait for every worker's report (its cache is allocated); returns
        the startup line."""
        try:
            self.reports = [rank0] + [self._receive_report(conn) for conn in self.conns]
        except RankDiedError:
            self.shutdown()
            raise
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


def start_ranks(config: EngineConfig, loaded: LoadedModel, block_size: int,
                num_blocks: int | None) -> tuple[TPWorkers, TPGroup]:
    """Spawn ranks 1..N-1, join them as rank 0 and keep rank 0's shard of
    `loaded` (in place). The workers load `config.model` themselves."""
    world_size = config.tensor_parallel_size
    device = rank_device(loaded.device, 0)
    if device.type == "cuda" and torch.cuda.device_count() < world_size:
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
    workers = TPWorkers(processes, conns)
    try:
        if device.type == "cpu":
            torch.set_num_threads(threads_per_rank(world_size))
        tp = init_tensor_parallel(0, world_size, port, device)
        shard_for_rank(loaded.model, 0, world_size)
    except Exception as exc:  # noqa: BLE001 - a worker that died while joining
        error = workers.failure(exc)
        workers.shutdown()
        raise error from exc
    return workers, tp


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
