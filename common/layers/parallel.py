"""Tensor parallelism, Megatron-LM style (ch08: `--tensor-parallel-size N`).

One model, N ranks (one process and one card each). Every matrix of a
Llama layer is cut in N, so that each rank holds 1/N of the weights and
1/N of the KV cache, and the ranks talk twice per layer:

    attention   q, k, v    column-parallel: rank r computes its own heads
                           (num_heads/N query heads, num_kv_heads/N KV heads)
                o_proj     row-parallel: a partial sum per rank -> all-reduce
    MLP         gate, up   column-parallel: 1/N of the intermediate features
                down_proj  row-parallel -> all-reduce
    embedding              vocab-parallel: rank r looks up its vocabulary
                           range, zeros elsewhere -> all-reduce
    LM head                vocab-parallel: rank r computes its slice of the
                           logits -> gathered on rank 0, which samples

("Column" and "row" are Megatron's names for X @ A with A of shape (in, out);
torch stores `weight` as (out, in), so a column-parallel layer keeps *rows*
of `weight`.) Norms and rotary embeddings are small: every rank keeps them.

This module holds what any model's split uses: cutting a linear layer by
output or input features, a vocabulary shard, the collectives (`TPGroup`,
which count the bytes they move). Which matrix is cut how is the model's
business: `shard_llama_for_rank` in common/models/llama.py, and the check
that a model can be split, `check_tensor_parallel`, in
common/models/__init__.py. Building a rank: common/worker/worker.py;
starting them: common/worker/tp_workers.py.

Left out: pipeline parallelism, sequence parallelism, replicating KV heads
when N exceeds their number (vLLM does; we refuse), custom all-reduce
kernels, GPT-2 (tensor parallelism here covers the Llama family), and
quantized weights together with tensor parallelism.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn


TIMEOUT_S = 60.0  # a collective that waits longer than this fails (a rank is stuck)


# --------------------------------------------------------- the sharding
def _keep(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.contiguous().clone(), requires_grad=False)


def shard_output_features(layer: nn.Linear, rank: int, world_size: int) -> None:
    """Column-parallel: keep this rank's 1/N of the output features.
    weight (out, in) -> (out/N, in); the bias too."""
    size = layer.out_features // world_size
    rows = slice(rank * size, (rank + 1) * size)
    layer.weight = _keep(layer.weight[rows])  # (out/N, in)
    if layer.bias is not None:
        layer.bias = _keep(layer.bias[rows])
    layer.out_features = size


def shard_input_features(layer: nn.Linear, rank: int, world_size: int) -> None:
    """Row-parallel: keep this rank's 1/N of the input features.
    weight (out, in) -> (out, in/N). The bias is added once, by rank 0:
    the all-reduce sums the ranks' partial outputs."""
    size = layer.in_features // world_size
    layer.weight = _keep(layer.weight[:, rank * size:(rank + 1) * size])  # (out, in/N)
    if layer.bias is not None and rank != 0:
        layer.bias = None
    layer.in_features = size


def vocab_shard(weight: torch.Tensor, rank: int, world_size: int) -> nn.Parameter:
    """Rows [rank * V/N, (rank + 1) * V/N) of a (vocab, hidden) matrix. When
    N does not divide the vocabulary, V/N is rounded up and the last shard
    is padded with rows of zeros (their logits are cut off after the gather)."""
    vocab = weight.shape[0]
    per_rank = -(-vocab // world_size)
    shard = weight[rank * per_rank:(rank + 1) * per_rank]
    padding = per_rank - shard.shape[0]
    if padding:
        shard = torch.cat([shard, shard.new_zeros(padding, weight.shape[1])])
    return _keep(shard)  # (V/N, hidden)


# -------------------------------------------------------- the collectives
@dataclass
class CommStats:
    """What this rank's collectives moved (bench/experiments/tensor_parallel.py reads it)."""
    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0  # size of each all-reduced tensor, summed
    all_reduce_seconds: float = 0.0  # waiting in them (on CUDA: launching them only)
    gather_calls: int = 0
    gather_bytes: int = 0  # logits arriving at rank 0 (its own slice included)


@dataclass
class TPGroup:
    """This process's place among the ranks, and the collectives.

    `group` carries the tensors of the forward pass (gloo on the CPU, NCCL
    on CUDA); `cpu_group` (gloo) carries small host-side agreements such
    as the number of KV blocks. With `world_size == 1` nothing is sent."""
    rank: int = 0
    world_size: int = 1
    group: object = None
    cpu_group: object = None
    stats: CommStats = field(default_factory=CommStats)

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; every rank gets the sum."""
        if self.world_size == 1:
            return x
        start = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.stats.all_reduce_seconds += time.perf_counter() - start
        self.stats.all_reduce_calls += 1
        self.stats.all_reduce_bytes += x.numel() * x.element_size()
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's logits (N, V/world_size) -> (N, vocab_size) on rank 0,
        None on the others."""
        if self.world_size == 1:
            return local
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)] \
            if self.rank == 0 else None
        dist.gather(local, parts, dst=0, group=self.group)
        if self.rank != 0:
            return None
        self.stats.gather_calls += 1
        self.stats.gather_bytes += local.numel() * local.element_size() * self.world_size
        return torch.cat(parts, dim=1)[:, :vocab_size]  # padding rows cut off

    def min_over_ranks(self, value: int) -> int:
        """The smallest `value` of all ranks (how many KV blocks fit on every card)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


SINGLE_RANK = TPGroup()  # world size 1: every collective is a no-op


def vocab_parallel_embedding(input_ids: torch.Tensor, weight: torch.Tensor,
                             tp: TPGroup) -> torch.Tensor:
    """input_ids (T,), weight: this rank's (V/N, hidden) rows -> (T, hidden).
    A token outside this rank's range gets a row of zeros; the all-reduce
    adds the one rank that has it."""
    start = tp.rank * weight.shape[0]
    local_ids = input_ids - start
    outside = (local_ids < 0) | (local_ids >= weight.shape[0])  # (T,)
    h = weight[local_ids.masked_fill(outside, 0)]  # (T, hidden)
    h = h.masked_fill(outside[:, None], 0.0)
    return tp.all_reduce(h)


def init_tensor_parallel(rank: int, world_size: int, port: int, device: torch.device,
                         timeout_s: float = TIMEOUT_S) -> TPGroup:
    """Join the ranks' process group (rank 0 hosts the rendezvous on `port`).
    Every collective fails after `timeout_s` instead of waiting forever."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" \
        else dist.group.WORLD
    return TPGroup(rank, world_size, dist.group.WORLD, cpu_group)


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
