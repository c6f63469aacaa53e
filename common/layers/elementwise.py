"""The elementwise work around a Llama layer's products (ch03; ch05 fused).

Three operations, one interface, as for attention (attention.py):

1. `rms_norm(x, weight, eps)`: HF's RMSNorm, in float32, back to x's dtype,
   times the weight.
2. `add_rms_norm(x, residual, weight, eps)`: the residual stream's add and
   the next norm: returns (rms_norm(residual + x), residual + x). Written
   this way (vLLM's `fused_add_rms_norm`) the forward pass hands the two to
   one call instead of adding, then norming.
3. `rotary(x, cos, sin)`: x * cos + rotate_half(x) * sin, for x (T, heads,
   head_dim) and cos, sin (T, head_dim).

`TorchElementwise` is the reference, in PyTorch ops: each op a pass over the
batch with its own temporary, about fifteen ops per layer. `CpuElementwise`
(ch05) does each operation in one pass in C++ (csrc/fused_ops_cpu.cpp), in
place, with PyTorch's roundings: the residual add and the rotary embedding
give PyTorch's numbers bit for bit; the norms add their sum of squares in
another order, so a value may round one step the other way
(tests/test_elementwise.py).
`elementwise_ops_for(device)` picks: C++ on the CPU where it builds, the
reference elsewhere (CUDA: one of vLLM's fused CUDA kernels would go here).

Left out: SiLU x up (PyTorch's vectorized exp is hard to beat by hand),
LayerNorm (GPT-2 keeps F.layer_norm).
"""
from __future__ import annotations

import functools

import torch

from common.layers import cpp_extensions


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchElementwise:
    """The reference, in PyTorch ops."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """As HF computes it: in float32, then back to the input dtype."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: (T, hidden) -> (normed, new residual)."""
        residual = residual + x
        return TorchElementwise.rms_norm(residual, weight, eps), residual

    @staticmethod
    def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (T, heads, D); cos, sin: (T, D)."""
        return x * cos[:, None] + rotate_half(x) * sin[:, None]


def build_extension():
    """The compiled kernels' Python module (built on first use)."""
    return cpp_extensions.build("fused_ops_cpu")


class CpuElementwise(TorchElementwise):
    """ch05: each operation one pass in C++, in place where it can."""

    @staticmethod
    def rms_norm(x, weight, eps):
        return build_extension().rms_norm(x, weight, eps)

    @staticmethod
    def add_rms_norm(x, residual, weight, eps):
        build_extension().fused_add_rms_norm(x, residual, weight, eps)  # both in place
        return x, residual

    @staticmethod
    def rotary(x, cos, sin):
        build_extension().rotary_embedding(x, cos, sin)  # in place
        return x


@functools.cache
def cpu_elementwise_ops() -> type[TorchElementwise]:
    """CpuElementwise where the kernels build; else the reference, said once."""
    return cpp_extensions.kernels_or_reference(build_extension, CpuElementwise,
                                               TorchElementwise, "norms and rotary")


def elementwise_ops_for(device: torch.device) -> type[TorchElementwise]:
    """C++ on the CPU (ch05), the PyTorch reference elsewhere."""
    return cpu_elementwise_ops() if device.type == "cpu" else TorchElementwise
