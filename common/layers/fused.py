"""Fused projections (ch05): linears that read the same input, multiplied as one.

A Llama layer's q, k and v projections all multiply the same normed hidden
states, and so do the MLP's gate and up projections: five matrix products
where one for q/k/v and one for gate/up give the same numbers. vLLM loads
them that way (`QKVParallelLinear`, `MergedColumnParallelLinear`). At decode
batch sizes (32-64 rows) a CPU pays for each product's call as well as its
arithmetic: fewer, wider products go faster (bench/results/*-profile*.md).

The HF model keeps its modules. `fuse_linears` concatenates their weights
into one tensor once and points each module's weight at its own rows of
it: a view, so no second copy is kept and HF's forward still runs, on the
same memory. Building it again on the same modules finds the fused tensor
and reuses it.

Left out: fusing quantized linears (ch08's QuantLinear keeps one product
each), fusing across layers, fusing the elementwise work around them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from common.layers.cpu_gemm import Gemm, dense_gemm


@dataclass
class FusedLinear:
    """One product for several linears; `__call__` returns their outputs."""
    weight: torch.Tensor  # (sum of their out_features, in_features)
    bias: torch.Tensor | None  # (sum of their out_features,), or None
    sizes: list[int]  # each linear's out_features, in order
    gemm: Gemm = field(init=False)  # the product: F.linear, or packed (cpu_gemm.py)

    def __post_init__(self):
        self.gemm = dense_gemm(self.weight, self.bias)  # ch05: packed on a CPU

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: (T, in_features) -> one (T, size) output per linear (views)."""
        return self.gemm(x).split(self.sizes, dim=-1)

    def __deepcopy__(self, memo) -> None:
        """A deep copy of the model drops it (the module's `fused_linear`
        becomes None): the copy fuses its own weights again, and a packed
        oneDNN weight cannot be copied."""
        return None

    def holds(self, linears: list[nn.Module]) -> bool:
        """Are these linears' weights still views of this fused weight?"""
        storage = self.weight.untyped_storage().data_ptr()
        return all(type(m) is nn.Linear and m.weight.untyped_storage().data_ptr() == storage
                   for m in linears)


def fuse_linears(linears: list[nn.Module]) -> FusedLinear | None:
    """Fuse plain nn.Linear modules of one input (in place: their weights
    become views). None when one is not a plain nn.Linear (ch08: quantized)."""
    if not all(type(m) is nn.Linear for m in linears):
        return None
    found = getattr(linears[0], "fused_linear", None)
    if found is not None and found.holds(linears):
        return found
    sizes = [m.out_features for m in linears]
    weight = torch.cat([m.weight.detach() for m in linears])  # (sum(sizes), in_features)
    bias = None
    if any(m.bias is not None for m in linears):  # Qwen2: q/k/v biases
        bias = torch.cat([m.bias.detach() if m.bias is not None
                          else weight.new_zeros(m.out_features) for m in linears])
    start = 0
    for m, size in zip(linears, sizes):
        m.weight = nn.Parameter(weight[start:start + size], requires_grad=False)
        if m.bias is not None:
            m.bias = nn.Parameter(bias[start:start + size], requires_grad=False)
        start += size
    fused = FusedLinear(weight, bias, sizes)
    linears[0].fused_linear = fused  # found again by the next forward built on this model
    return fused
