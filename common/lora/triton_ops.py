"""The LoRA products of a batch that mixes adapters, as Triton kernels (ch10, CUDA).

The same products as the PyTorch reference in common/lora/punica.py, on
the same stacks, with vLLM's names (vllm/lora/ops/triton_ops: `bgmv_shrink`,
`bgmv_expand`; "bgmv": batched gather matrix-vector, from Punica):

    x: (T, in)    lora_a: (slots, r, in)    lora_b: (slots, out, r)
    scaling: (slots,)    indices: (T,), a slot or -1 (no adapter)

1. `bgmv_shrink`: h_t = scaling_s * A_s x_t, s = indices[t] -> h (T, r),
   kept in float32 (as vLLM's shrink buffer); rows of slot -1 get zeros.
2. `bgmv_expand`: y_t += B_s h_t, added *in place* into y (T, out); rows
   of slot -1 are not touched. y may be a view with its own row stride:
   the q, k and v outputs of one fused product are column slices of it.

`add_lora_triton` is the two in a row (punica.add_lora_gathered's
meaning), and `PunicaWrapperTriton` the step's mapping with the same two
methods as punica_wrapper.PunicaWrapper, for the LoRA layers of common/lora/layers.py.

One program per (token, tile of outputs): the token loads its slot, and
walks the reduction dimension BLOCK_K at a time, multiplying a (BLOCK_N,
BLOCK_K) tile of its slot's weight by a BLOCK_K piece of its row and
summing (a blocked reduction, in float32 whatever the inputs' dtype:
float32, bfloat16 or float16). No `tl.dot`: one row is a matrix-*vector*
product, each weight is used once per token, so the time goes to reading
the weights, not to multiplying them; tensor cores would not help. Masks
allow any in, out and rank. Nothing syncs with the host: a slot of -1 is
skipped inside the kernels, so the same launch suits CUDA graphs.

Each token reads its own slot's A and B, so a batch of many tokens on one
adapter reads that adapter many times (mostly from L2 cache). That is the
decode case's price; vLLM's segmented kernels (`lora_shrink` /
`lora_expand`, formerly `sgmv_*`) sort the tokens by slot and multiply a
tile of BLOCK_M tokens of one slot at once with `tl.dot`, reading the
weights once per tile: the better choice for prefills.

Runs on the CPU under the Triton interpreter (`TRITON_INTERPRET=1` set
before triton is first imported, CPU tensors): tests/test_lora_triton.py.
The kernels never ask `tl.dot` for a product, so bfloat16 can be checked
there too (the interpreter's `tl.dot` cannot multiply bfloat16).

Left out, on purpose: the segmented `lora_shrink`/`lora_expand` above;
vLLM's fused multi-slice launch (one shrink reads x once for q, k and v
together, one expand writes all three slices); split-K for the shrink
(cutting a long `in` across programs, summed with atomic adds); tuned
tile sizes per GPU (vLLM's configs/*.json); LoRA on the embedding and the
LM head; tensor parallelism.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.lora.punica import NO_LORA  # -1: a token that runs the base model alone


# Tile sizes. SHRINK_BLOCK_K: input features per step of the shrink's
# reduction; EXPAND_BLOCK_N: outputs per program of the expand; MAX_BLOCK_R:
# the largest tile along the rank (the shrink's outputs, the expand's
# reduction): ranks up to 64 fit in one tile, larger ones take several.
SHRINK_BLOCK_K = 64
EXPAND_BLOCK_N = 64
MAX_BLOCK_R = 64


# --------------------------------------------------------------------------
# The shared piece: one row times one tile of a weight matrix
# --------------------------------------------------------------------------

@triton.jit
def _row_times_weight_tile(
    row_ptr, row_stride,  # one token's row: (K,)
    w_ptr, w_stride_n, w_stride_k,  # its slot's weight: (N, K)
    n_offsets,  # (BLOCK_N,) the outputs of this tile
    N, K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """acc[n] = sum_k w[n, k] * row[k] for the tile's n: (BLOCK_N,) float32."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    n_mask = n_offsets < N  # (BLOCK_N,) the last tile may be partial
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
        k_mask = ks < K
        row = tl.load(row_ptr + ks * row_stride, mask=k_mask, other=0.0)  # (BLOCK_K,)
        w = tl.load(w_ptr + n_offsets[:, None] * w_stride_n + ks[None, :] * w_stride_k,
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # (BLOCK_N, BLOCK_K)
        acc += tl.sum(w.to(tl.float32) * row.to(tl.float32)[None, :], axis=1)
    return acc


# --------------------------------------------------------------------------
# 1. bgmv_shrink: h = scaling * A x, each token with its own slot's A
# --------------------------------------------------------------------------

@triton.jit
def _bgmv_shrink_kernel(
    x_ptr,  # (T, in)
    lora_a_ptr,  # (slots, r, in)
    scaling_ptr,  # (slots,)
    indices_ptr,  # (T,) a slot or -1
    h_ptr,  # (T, r) float32, written
    R, K,  # rank, in
    x_stride_t, x_stride_k,
    a_stride_slot, a_stride_r, a_stride_k,
    h_stride_t, h_stride_r,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)  # one program per (token, tile of the rank)
    r_offsets = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    h_ptrs = h_ptr + token * h_stride_t + r_offsets * h_stride_r
    slot = tl.load(indices_ptr + token).to(tl.int64)
    if slot < 0:  # NO_LORA
        tl.store(h_ptrs, tl.zeros([BLOCK_R], dtype=tl.float32), mask=r_offsets < R)
        return
    acc = _row_times_weight_tile(
        x_ptr + token * x_stride_t, x_stride_k,
        lora_a_ptr + slot * a_stride_slot, a_stride_r, a_stride_k,
        r_offsets, R, K, BLOCK_R, BLOCK_K)  # (BLOCK_R,)
    scale = tl.load(scaling_ptr + slot).to(tl.float32)  # the slot's alpha / r
    tl.store(h_ptrs, acc * scale, mask=r_offsets < R)


def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor,
                scaling: torch.Tensor) -> torch.Tensor:
    """x: (T, in); lora_a: (slots, r, in); indices: (T,), a slot or -1;
    scaling: (slots,). Returns h (T, r) float32: each row times its slot's A,
    times its slot's scaling; zeros for the rows of slot -1."""
    (num_tokens, in_features), (_, rank, _) = x.shape, lora_a.shape
    _check_shrink_inputs(x, lora_a, indices, scaling)
    h = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return h
    block_r = min(triton.next_power_of_2(rank), MAX_BLOCK_R)
    grid = (num_tokens, triton.cdiv(rank, block_r))
    _bgmv_shrink_kernel[grid](
        x, lora_a, scaling, indices.contiguous(), h,
        rank, in_features,
        *x.stride(), *lora_a.stride(), *h.stride(),
        BLOCK_R=block_r, BLOCK_K=SHRINK_BLOCK_K,
    )
    return h


# --------------------------------------------------------------------------
# 2. bgmv_expand: y += B h, in place, each token with its own slot's B
# --------------------------------------------------------------------------

@triton.jit
def _bgmv_expand_kernel(
    h_ptr,  # (T, r)
    lora_b_ptr,  # (slots, out, r)
    indices_ptr,  # (T,) a slot or -1
    y_ptr,  # (T, out), added into; may be a column slice of a wider tensor
    N, R,  # out, rank
    h_stride_t, h_stride_r,
    b_stride_slot, b_stride_n, b_stride_r,
    y_stride_t, y_stride_n,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)  # one program per (token, tile of outputs)
    slot = tl.load(indices_ptr + token).to(tl.int64)
    if slot < 0:  # NO_LORA
        return  # the base model's output stays as it is
    n_offsets = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    delta = _row_times_weight_tile(
        h_ptr + token * h_stride_t, h_stride_r,
        lora_b_ptr + slot * b_stride_slot, b_stride_n, b_stride_r,
        n_offsets, N, R, BLOCK_N, BLOCK_R)  # (BLOCK_N,)
    y_ptrs = y_ptr + token * y_stride_t + n_offsets * y_stride_n
    n_mask = n_offsets < N
    y = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    # The add happens in float32, then rounds once to y's dtype.
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def bgmv_expand(h: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor,
                y: torch.Tensor) -> None:
    """h: (T, r); lora_b: (slots, out, r); indices: (T,), a slot or -1.
    Adds each row's B_s h_t into y (T, out) in place (vLLM's
    add_inputs=True); the rows of slot -1 are left as they are. y may be
    a view with any strides (a column slice of a fused output)."""
    (num_tokens, rank), out_features = h.shape, lora_b.shape[1]
    _check_expand_inputs(h, lora_b, indices, y)
    if num_tokens == 0:
        return
    grid = (num_tokens, triton.cdiv(out_features, EXPAND_BLOCK_N))
    _bgmv_expand_kernel[grid](
        h, lora_b, indices.contiguous(), y,
        out_features, rank,
        *h.stride(), *lora_b.stride(), *y.stride(),
        BLOCK_N=EXPAND_BLOCK_N,
        BLOCK_R=min(triton.next_power_of_2(rank), MAX_BLOCK_R),
    )


# --------------------------------------------------------------------------
# The two together, and the wrapper the LoRA layers call
# --------------------------------------------------------------------------

def add_lora_triton(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                    lora_b: torch.Tensor, scaling: torch.Tensor,
                    indices: torch.Tensor) -> None:
    """y (T, out) += x's rows through their own adapters, in place: the
    meaning of punica.add_lora_gathered, in two launches."""
    h = bgmv_shrink(x, lora_a, indices, scaling)  # (T, r) float32
    bgmv_expand(h, lora_b, indices, y)


class PunicaWrapperTriton:
    """The step's mapping for the Triton kernels (vLLM's PunicaWrapperGPU):
    the same two calls as punica_wrapper.PunicaWrapper, so the LoRA layers do not
    know which one they hold. The model runner sets it before each pass."""

    def __init__(self):
        self.token_lora_indices = torch.empty(0, dtype=torch.int32)  # (T,)
        self.any_lora = False

    def update_metadata(self, token_lora_indices: torch.Tensor) -> None:
        """token_lora_indices: (T,) each token's slot or -1, on the device."""
        self.token_lora_indices = token_lora_indices.to(torch.int32).contiguous()
        # One host sync per step, not per layer: a step with no adapter
        # launches nothing (vLLM keeps the same flag, `no_lora_flag_cpu`).
        self.any_lora = bool((self.token_lora_indices != NO_LORA).any())

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                        lora_b: torch.Tensor, scaling: torch.Tensor) -> None:
        """y (T, out) += each token's adapter's change of x (T, in), in place."""
        if self.any_lora:
            add_lora_triton(y, x, lora_a, lora_b, scaling, self.token_lora_indices)


# --------------------------------------------------------------------------
# Helpers of the wrappers
# --------------------------------------------------------------------------

def _check_shrink_inputs(x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor,
                         scaling: torch.Tensor) -> None:
    assert x.dim() == 2 and lora_a.dim() == 3, (
        f"x must be (T, in) and lora_a (slots, r, in); got {tuple(x.shape)} and "
        f"{tuple(lora_a.shape)}")
    assert x.shape[1] == lora_a.shape[2], (
        f"x has {x.shape[1]} features, lora_a expects {lora_a.shape[2]}")
    assert indices.shape == (x.shape[0],), (
        f"indices must be (T,) = ({x.shape[0]},); got {tuple(indices.shape)}")
    assert scaling.shape == (lora_a.shape[0],), (
        f"scaling must be (slots,) = ({lora_a.shape[0]},); got {tuple(scaling.shape)}")
    assert not indices.is_floating_point(), "indices must be integers (slots, -1: none)"


def _check_expand_inputs(h: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor,
                         y: torch.Tensor) -> None:
    assert h.dim() == 2 and lora_b.dim() == 3 and y.dim() == 2, (
        f"h must be (T, r), lora_b (slots, out, r), y (T, out); got {tuple(h.shape)}, "
        f"{tuple(lora_b.shape)}, {tuple(y.shape)}")
    assert h.shape[1] == lora_b.shape[2], (
        f"h has rank {h.shape[1]}, lora_b expects {lora_b.shape[2]}")
    assert y.shape == (h.shape[0], lora_b.shape[1]), (
        f"y must be (T, out) = ({h.shape[0]}, {lora_b.shape[1]}); got {tuple(y.shape)}")
    assert indices.shape == (h.shape[0],), (
        f"indices must be (T,) = ({h.shape[0]},); got {tuple(indices.shape)}")
