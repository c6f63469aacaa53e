"""A Worker per rank (ch03-06): one rank's device, weights, KV cache and ModelRunner.

Every rank of the engine is built by one function, `build_worker`, in one
order (vLLM's `Worker`; nano-vllm builds each rank as `ModelRunner(config,
rank, event)`):

1. the device: cuda:r, or the CPU; ch08, on more than one rank: the rank's
   share of the CPU cores and its place in the process group;
2. the model: loaded (rank 0 is given the engine's), quantized in place
   (ch08, `--quantization`), cut to this rank's shard (ch08);
3. the card: the weights booked, then as many KV blocks as the rest holds
   (or the number given), the smallest number over the ranks (ch08);
4. the KV cache, the `ModelRunner`, and on CUDA the decode graphs (ch05);
5. a `RankReport`, what rank 0 logs at startup.

Rank 0 builds its Worker in the engine's process (common/engine/llm_engine.py);
ranks 1..N-1 build theirs in the worker processes that
common/worker/tp_workers.py starts (`worker_main`), then run every step
rank 0 sends them (`Worker.serve`).

Left out: vLLM's memory profiling with the real sampler, sleep mode and
weight reloading, LoRA, several ranks per process, a rank per GPU chosen
by the user (rank r takes cuda:r).
"""
from __future__ import annotations

import logging
import os
import sys
import traceback
from dataclasses import dataclass

import torch

from common.config import EngineConfig
from common.worker.kv_cache import KVCache, num_blocks_for_card
from common.worker.model_runner import ModelRunner
from common.layers.parallel import (
    SINGLE_RANK,
    TPGroup,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from common.layers.cascade_attention import supports_cascade
from common.layers.quantization import CpuPackedQuantOps, QuantScheme, quantize_linears
from common.loader import LoadedModel, load_model, pick_device
from common.memory import Card, format_bytes
from common.models import build_forward, quantizable_linears, shard_for_rank

log = logging.getLogger("llm-course")
STOP = "stop"  # what rank 0 sends a worker process to end it (ch08)


# ------------------------------------------------ the messages (ch06)
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
    """Sent by a worker process before it exits on an error."""
    rank: int
    error: str


# ------------------------------------------------------------ the rank
def rank_device(device: str | torch.device, rank: int) -> torch.device:
    """Rank r's card: cuda:r, or the CPU (a simulated card per rank)."""
    device = pick_device(str(device)) if isinstance(device, str) else device
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def threads_per_rank(world_size: int) -> int:
    """On the CPU the ranks share the cores: each gets its part."""
    return max(1, (os.cpu_count() or 1) // world_size)


def quant_ops_for(device: torch.device):
    """How `--quantization` multiplies (ch08): the Triton kernels on CUDA,
    PyTorch's packed kernels on the CPU."""
    if device.type == "cuda":
        from common.layers.quant_kernels import TritonQuantOps  # Triton: CUDA only
        return TritonQuantOps
    return CpuPackedQuantOps


@dataclass
class Worker:
    """One rank's share of the engine: what `build_worker` made."""
    rank: int
    device: torch.device
    tp: TPGroup  # this rank's place among the ranks (SINGLE_RANK on one)
    loaded: LoadedModel  # the model, quantized and cut to this rank's shard
    card: Card  # the weights and the KV cache booked on it
    kv_cache: KVCache  # this rank's KV heads of every block
    model_runner: ModelRunner
    report: RankReport

    @property
    def weight_bytes(self) -> int:
        return self.report.weight_bytes

    def serve(self, conn) -> None:
        """Ranks 1..N-1 (ch08): run every step rank 0 sends, until "stop"
        (or until rank 0 is gone)."""
        while True:
            try:
                step = conn.recv()
            except EOFError:  # rank 0's end of the pipe closed: it is gone
                return
            if step == STOP:
                return
            self.model_runner.forward_logits(step)  # all-reduces inside; logits go to rank 0


def build_worker(config: EngineConfig, rank: int, block_size: int, num_blocks: int | None,
                 *, loaded: LoadedModel | None = None, model_shared: bool = False,
                 port: int | None = None,
                 attention_ops=None, quant_ops=None, workers=None,
                 sampling=None, logits_processors: tuple = (), adapters_cls=None) -> Worker:
    """Build rank `rank` (0 in the engine's process, 1..N-1 in the workers').

    `loaded`: the model, when the caller has it (rank 0); otherwise this rank
    loads `config.model`. `model_shared`: the caller runs HF's own forward on
    `loaded` too (the tests' reference), so its plain weights stay whole
    beside their packed copies (ch05); else they are freed. `num_blocks`: a
    fixed cache size (tests) instead of sizing from the card. `port` (ch08):
    the ranks' rendezvous. `attention_ops`, `quant_ops`: the components,
    replaceable (default: picked for the device).
    `workers` (ch08, rank 0): the other ranks (tp_workers.TPWorkers), which
    the ModelRunner sends every step to. `sampling`, `logits_processors`
    (rank 0): the ModelRunner's sampling step and logits processors, the
    chapter's parts (common/engine/parts.py); the other ranks never sample.
    `adapters_cls` (ch10, rank 0): the LoRA slots, built on the forward pass."""
    world_size = config.tensor_parallel_size
    device = rank_device(loaded.device if loaded is not None else config.device, rank)
    tp = SINGLE_RANK
    if world_size > 1:  # ch08: the rank's cores, its place in the process group
        if device.type == "cpu":
            torch.set_num_threads(threads_per_rank(world_size))
        tp = init_tensor_parallel(rank, world_size, port, device)
    loaded = loaded or load_model(config.model, config.dtype, str(device), config.load_format,
                                  config.seed)
    model = loaded.model
    if config.quantization:  # ch08: weight-only int8/int4, swapped in place
        scheme = QuantScheme(config.quantization)
        quantize_linears(model, quantizable_linears(model, scheme), scheme,
                         quant_ops or quant_ops_for(device))
    if world_size > 1:
        shard_for_rank(model, rank, world_size)  # ch08: keep this rank's share, in place
    forward = build_forward(model, attention_ops, tp)
    if not model_shared:
        forward.release_plain_weights()  # ch05: the packed copies are all it reads
    card = Card(device, config.device_memory_gb, config.gpu_memory_utilization)
    weight_bytes = card.charge_weights(model, forward.packed_bytes)
    log.info("weights: %s (%s%s)", format_bytes(weight_bytes),
             config.quantization or str(loaded.dtype).removeprefix("torch."),
             f", {format_bytes(forward.packed_bytes)} of them packed copies for oneDNN"
             if forward.packed_bytes else "")  # ch05: common/layers/cpu_gemm.py
    # ch10: the LoRA slots, on the card before the KV cache takes what is left
    adapters = adapters_cls(forward, loaded.dtype, card) if adapters_cls else None
    room = num_blocks
    if room is None:
        room, line = num_blocks_for_card(card, model, block_size,
                                         config.max_num_batched_tokens, world_size)
        log.info(line)
    num_blocks = tp.min_over_ranks(room)  # ch08: the same blocks on every card
    kv_cache = KVCache(card, model.config, num_blocks, block_size, loaded.dtype, world_size)
    cascade = not config.disable_cascade_attn and supports_cascade(forward.attention_ops)
    runner = ModelRunner(forward, kv_cache, workers, sampling, logits_processors,
                         cascade_attention=cascade,  # ch05: where the kernels have it
                         adapters=adapters)
    if device.type == "cuda" and not config.enforce_eager and attention_ops is None \
            and world_size == 1 and adapters is None:  # ch05: graphs need the Triton
        # kernels and one rank; ch10: a graph would keep the step it was captured
        # with (no adapter): with LoRA every step runs eagerly (left out: vLLM's
        # graphs captured per number of adapters)
        runner.capture_decode_graphs(config.max_num_seqs,
                                     config.context_length(loaded.max_model_len))
    block_bytes = KVCache.bytes_per_block(model.config, block_size, loaded.dtype, world_size)
    return Worker(rank, device, tp, loaded, card, kv_cache, runner,
                  RankReport(rank, weight_bytes, room, num_blocks, block_bytes))


def worker_main(config: EngineConfig, rank: int, port: int, block_size: int,
                num_blocks: int | None, conn) -> None:
    """The body of worker process `rank` (1..N-1, ch08): build the rank,
    report, serve the steps."""
    try:
        worker = build_worker(config, rank, block_size, num_blocks, port=port)
        conn.send(worker.report)
        worker.serve(conn)
    except Exception as exc:  # noqa: BLE001 - tell rank 0, then exit non-zero
        traceback.print_exc()
        try:
            conn.send(WorkerFailed(rank, f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        sys.exit(1)
    finally:
        destroy_tensor_parallel()
