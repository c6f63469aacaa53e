"""Weight-only quantized matmuls as Triton kernels (ch08, CUDA).

The same two calls as `ReferenceQuantOps` in common/layers/quantization.py
(`quantize` stores a weight, `linear` multiplies by it), on the same
storage: int8 `qweight (N, K)` with `scales (N,)`; int4 `qweight (N, K // 2)`
(two values per byte, even k in the low 4 bits) with float16 `scales` and
`mins (N, K // 32)`.

One program computes a (BLOCK_M, BLOCK_N) tile of `out = x @ W.T`, walking
K in steps: it loads a tile of the *small* integers, turns them into floats
in registers (`q * scale` for int8; `q * scale[g] + min[g]` for int4, g the
group of each k) and multiplies with `tl.dot`. The weights cross memory as
1 byte (int8) or half a byte (int4) per value, which is the whole point:
a decode step reads every weight once and is bound by those bytes.

int4 without shuffling nibbles: a byte holds k = 2j and k = 2j + 1, so the
kernel loads the even and the odd columns of x separately (a stride of 2)
and does two products per step, one with the low nibbles and one with the
high ones.

float32 inputs use exact float32 products (`input_precision="ieee"`), so
the results match the reference to ~1e-5. Runs on the CPU under the
Triton interpreter (`TRITON_INTERPRET=1`, CPU tensors):
tests/test_quantization.py does that.

Left out: autotuned tile sizes, split-K for very small M, a dedicated
M = 1 (GEMV) kernel, tensor-core friendly weight layouts (Marlin, AWQ's
interleaved packing).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.layers.quantization import GROUP_SIZE, QuantScheme, ReferenceQuantOps

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64  # BLOCK_K: input channels per step


@triton.jit
def _int8_matmul_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :],
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        q = tl.load(w_ptr + cols[None, :] * K + ks[:, None],  # (BLOCK_K, BLOCK_N) of W.T
                    mask=(cols[None, :] < N) & (ks[:, None] < K), other=0)
        acc += tl.dot(x, q.to(x.dtype), input_precision=PRECISION)
    scale = tl.load(scale_ptr + cols, mask=cols < N, other=0.0)  # one per output channel
    out = acc * scale[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _int4_matmul_kernel(x_ptr, w_ptr, scale_ptr, min_ptr, out_ptr, M, N, K,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    half_k, num_groups = K // 2, K // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j0 in range(0, half_k, BLOCK_K // 2):
        js = j0 + tl.arange(0, BLOCK_K // 2)  # byte columns: k = 2j and 2j + 1
        row_mask = (rows[:, None] < M) & (js[None, :] < half_k)
        x_even = tl.load(x_ptr + rows[:, None] * K + 2 * js[None, :], mask=row_mask, other=0.0)
        x_odd = tl.load(x_ptr + rows[:, None] * K + 2 * js[None, :] + 1, mask=row_mask, other=0.0)
        w_mask = (cols[None, :] < N) & (js[:, None] < half_k)
        packed = tl.load(w_ptr + cols[None, :] * half_k + js[:, None], mask=w_mask, other=0)
        groups = (2 * js[:, None]) // GROUP  # (BLOCK_K // 2, 1): both nibbles share it
        scale = tl.load(scale_ptr + cols[None, :] * num_groups + groups, mask=w_mask, other=0.0)
        low = (packed & 0xF).to(tl.float32) * scale.to(tl.float32)
        high = (packed >> 4).to(tl.float32) * scale.to(tl.float32)
        offset = tl.load(min_ptr + cols[None, :] * num_groups + groups, mask=w_mask, other=0.0)
        low += offset.to(tl.float32)
        high += offset.to(tl.float32)
        acc += tl.dot(x_even, low.to(x_even.dtype), input_precision=PRECISION)
        acc += tl.dot(x_odd, high.to(x_odd.dtype), input_precision=PRECISION)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # ignored for 16-bit inputs


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x: (M, K); qweight: (N, K) int8; scales: (N,) -> (M, N) in x's dtype."""
    x = x.contiguous()
    (m, k), n = x.shape, qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _int8_matmul_kernel[grid](x, qweight, scales.float(), out, m, n, k,
                              BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                              PRECISION=_precision(x.dtype))
    return out


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                mins: torch.Tensor) -> torch.Tensor:
    """x: (M, K); qweight: (N, K // 2) uint8; scales, mins: (N, K // 32) -> (M, N)."""
    x = x.contiguous()
    (m, k), n = x.shape, qweight.shape[0]
    if k % GROUP_SIZE:
        raise ValueError(f"int4 needs K divisible by {GROUP_SIZE}, got {k}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _int4_matmul_kernel[grid](x, qweight, scales, mins, out, m, n, k, GROUP=GROUP_SIZE,
                              BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                              PRECISION=_precision(x.dtype))
    return out


class TritonQuantOps:
    """The reference's storage, multiplied by the kernels above."""
    name = "triton (dequantize tiles in registers)"
    quantize = staticmethod(ReferenceQuantOps.quantize)

    @staticmethod
    def linear(x: torch.Tensor, layer) -> torch.Tensor:
        if layer.scheme is QuantScheme.INT8:
            out = int8_linear(x, layer.qweight, layer.scales)
        else:
            out = int4_linear(x, layer.qweight, layer.scales, layer.mins)
        return out if layer.bias is None else out + layer.bias
