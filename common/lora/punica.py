"""The LoRA products of a batch that mixes adapters (ch10; vLLM's Punica ops).

In one step the batch's tokens belong to sequences of different adapters,
or of none. Every projection runs once for all of them with the base
weight, as in chapters 03-09; then each token adds its own adapter's
low-rank change. The adapters sit in `max_loras` slots, stacked:

    lora_a: (slots, r, in)     lora_b: (slots, out, r)     scaling: (slots,)

(scaling: each adapter's alpha / r), and `token_lora_indices` (T,) says
each token's slot (-1: none). A token t of slot s gets
y_t += scaling_s * B_s (A_s x_t). Three equal ways to compute it
(Punica: Chen et al., 2023, arXiv:2310.18547; S-LoRA: Sheng et al.,
2023, arXiv:2311.03285), the first two here:

- gathered, per token (vLLM's `bgmv_shrink` / `bgmv_expand`): each row
  picks its own A and B out of the stack, `lora_a[indices]`: (T, r, in).
  Short to write, the reference; it copies one A and one B per token;
- grouped, per adapter (vLLM's `sgmv`: segments of tokens that share an
  adapter): for each slot in use, its rows in two small products,
  `(x[rows] @ A^T) @ B^T`, added back at those rows: 5 small operations
  per slot, per projection, per layer;
- stacked, every slot at once (common/lora/punica_wrapper.py, with the
  wrapper that picks one of the three for the model's LoRA layers).

Left out: the fused kernels of vLLM's Triton and CUDA ops (one launch for
every slice and slot), LoRA on the embedding and the LM head.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

NO_LORA = -1  # a token of a sequence that runs the base model alone


def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor,
                scaling: torch.Tensor) -> torch.Tensor:
    """x: (T, in); lora_a: (slots, r, in); indices: (T,), every one a slot;
    scaling: (slots,). Returns (T, r): each row times its own adapter's A,
    scaled by its alpha / r (vLLM's shrink applies the scale too)."""
    a = lora_a[indices]  # (T, r, in): row t's A
    return torch.einsum("ti,tri->tr", x, a) * scaling[indices, None]


def bgmv_expand(h: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """h: (T, r); lora_b: (slots, out, r). Returns (T, out): each row's B."""
    b = lora_b[indices]  # (T, out, r)
    return torch.einsum("tr,tor->to", h, b)


def add_lora_gathered(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                      lora_b: torch.Tensor, scaling: torch.Tensor,
                      indices: torch.Tensor) -> None:
    """The reference: y (T, out) += x's rows through their own adapters, in place."""
    rows = (indices != NO_LORA).nonzero().squeeze(1)  # (R,): the rows with an adapter
    if len(rows) == 0:
        return
    slots = indices[rows]  # (R,)
    h = bgmv_shrink(x[rows], lora_a, slots, scaling)  # (R, r)
    y.index_add_(0, rows, bgmv_expand(h, lora_b, slots))


@dataclass
class LoRAMapping:
    """One step's tokens and their slots, in the two forms the products use."""
    token_lora_indices: torch.Tensor  # (T,) int64, a slot or NO_LORA
    # the grouped form: each slot in use, and its rows (R_s,) int64
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def from_indices(cls, indices: torch.Tensor) -> "LoRAMapping":
        groups = [(int(slot), (indices == slot).nonzero().squeeze(1))
                  for slot in indices.unique().tolist() if slot != NO_LORA]
        return cls(indices, groups)


def add_lora_grouped(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                     lora_b: torch.Tensor, scaling: torch.Tensor,
                     mapping: LoRAMapping) -> None:
    """The same as `add_lora_gathered`, one slot at a time: two small products each."""
    for slot, rows in mapping.groups:
        scale = float(scaling[slot])
        if len(rows) == x.shape[0]:  # the whole batch on one adapter: no gather
            y += ((x @ lora_a[slot].T) * scale) @ lora_b[slot].T
            continue
        h = (x.index_select(0, rows) @ lora_a[slot].T) * scale  # (R_s, r)
        y.index_add_(0, rows, h @ lora_b[slot].T)  # (R_s, out) added at its rows
