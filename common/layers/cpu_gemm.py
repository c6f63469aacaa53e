"""Matrix products on the CPU with each weight packed once for oneDNN (ch05).

In bfloat16 on a CPU, `F.linear` calls oneDNN with the weight in its plain
row-major layout, and oneDNN rearranges it for its kernels (AMX tiles,
AVX-512 blocks) on every call. Rearranged once, when the engine starts,
a decode step of 64 sequences goes 1.22x faster
(bench/results/2026-12-02-vm-profile.md). In float32 `F.linear` calls MKL,
whose small-batch products are slow on AMD CPUs: packed for oneDNN, a
float32 step goes 1.83x faster at 32 sequences and 1.36x at 64 on an AMD
EPYC (bench/results/2026-12-04-vm-profile-epyc.md). vLLM's CPU backend
does the same (`dispatch_cpu_unquantized_gemm`, its `onednn_mm` op), and
so does torch.compile's weight freezing on the CPU: here through the same
two PyTorch ops, `mkldnn._reorder_linear_weight` and
`mkldnn._linear_pointwise`.

The numbers: F.linear's bit for bit in bfloat16 (the same oneDNN kernels,
minus the rearranging); in float32 oneDNN's sums round differently from
MKL's, by rounding only (tests/test_cpu_gemm.py; the greedy tokens stay
HF's and vLLM's in the differential tests).

`gemm_for(module)` returns what the forward pass calls for one linear:
a `PackedLinear` (on a CPU with oneDNN: float32, and bfloat16 where it
computes it), `F.linear` on the module's weight (CUDA), or the module
itself (ch08: a quantized linear multiplies by its own quantized weight).
`OneDnnLinear` reads a weight that must stay plain (a tied LM head) in
place. Once packed, an engine that loaded its own model frees the plain
weights (`release_plain_weight`, as vLLM does); one handed a model by its
caller (the tests' HF reference) leaves it whole, and the card is charged
for both copies (`packed_bytes`).

Left out: float16, quantized weights, a packed copy per batch-size bucket.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

Gemm = Callable[[torch.Tensor], torch.Tensor]  # x (T, in_features) -> (T, out_features)


def packs_weights(weight: torch.Tensor) -> bool:
    """Does this weight go faster packed? On a CPU with oneDNN: float32, and
    bfloat16 where its oneDNN computes bfloat16."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear:
    """x @ weight.T + bias through oneDNN, with the weight rearranged once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        # An opaque oneDNN tensor: only mkldnn._linear_pointwise reads it.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.bias = None if bias is None else bias.detach()  # (out_features,)
        self.nbytes = weight.numel() * weight.element_size()  # the copy's size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, in_features) -> (T, out_features)."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class OneDnnLinear:
    """x @ weight.T + bias through oneDNN, the weight read in its own plain
    layout: for a float32 weight that must stay plain (an LM head tied to
    the embedding), where a packed copy would be a second one. On a 2-core
    AMD EPYC it beats MKL's product (F.linear) 1.6x at 64 rows and 2x at 32
    (SmolLM2's head; the packed copy is 1.15x faster still)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight.detach()  # (out_features, in_features), not copied
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, in_features) -> (T, out_features)."""
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def dense_gemm(weight: torch.Tensor, bias: torch.Tensor | None = None,
               unpacked: Gemm | None = None) -> Gemm:
    """The product with this weight: packed where that pays, else `unpacked`
    (default: F.linear on the weight)."""
    if packs_weights(weight):  # ch05
        return PackedLinear(weight, bias)
    return unpacked or functools.partial(F.linear, weight=weight, bias=bias)


def gemm_for(module: nn.Module) -> Gemm:
    """What the forward pass calls for this linear layer: its product,
    packed or not, or the module itself when it is not a plain nn.Linear
    (ch08: QuantLinear, common/layers/quantization.py)."""
    if type(module) is nn.Linear:
        return dense_gemm(module.weight, module.bias)
    return module


def release_plain_weight(module: nn.Module) -> None:
    """Free a linear's own weight once its packed copy is all the forward
    pass reads (ch05; vLLM frees it too): the module keeps an empty tensor,
    so its own forward no longer runs."""
    module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)


def packed_bytes(gemms: list) -> int:
    """Bytes of the packed copies among these products (charged to the card)."""
    return sum(g.nbytes for g in gemms if isinstance(g, PackedLinear))
