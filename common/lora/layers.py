"""A model's products with LoRA slots beside them (ch10; vLLM's lora/layers).

Each wrapper keeps the base product the model already had (packed for
oneDNN, fused) and adds, for every adapter slot, that projection's A and B
(zeros where the adapter leaves it alone, or where the slot is free):

- `LinearWithLoRA`: one projection (o_proj, down_proj);
- `MergedLinearWithLoRA`: several projections run as one product
  (q/k/v, gate/up: common/layers/fused.py), each output slice with its own
  A and B, as vLLM's `MergedColumnParallelLinearWithLoRA`.

A rank below `max_lora_rank` is padded with zeros: the extra columns of A
and rows of B add nothing.

Left out: tensor parallelism (the A or the B of a shard), quantized base
products (chapter 08's), vLLM's single shrink of q, k and v together.
"""
from __future__ import annotations

import torch

from common.lora.lora_model import LoRALayerWeights
from common.lora.punica_wrapper import PunicaWrapper


class LoRASlots:
    """One projection's stacked adapters: A (slots, r, in), B (slots, out, r),
    and each slot's alpha / r (slots,)."""

    def __init__(self, max_loras: int, max_rank: int, in_features: int, out_features: int,
                 dtype: torch.dtype, device: torch.device, card=None):
        """`card` (a common.memory.Card): where the stacks are booked, as
        the weights and the KV cache are; None: plain tensors (tests)."""
        def zeros(*shape: int) -> torch.Tensor:
            if card is None:
                return torch.zeros(shape, dtype=dtype, device=device)
            return card.allocate(shape, dtype, "LoRA slots")
        self.lora_a = zeros(max_loras, max_rank, in_features)  # (S, r, in)
        # B is kept as (S, r, out): all the slots' B read as one (S * r, out)
        # matrix without a copy (punica_wrapper.add_lora_stacked). `lora_b` is its
        # transposed view, (S, out, r): vLLM's layout, what the other forms read.
        self.lora_b_t = zeros(max_loras, max_rank, out_features)
        self.lora_b = self.lora_b_t.transpose(1, 2)
        self.scaling = zeros(max_loras)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.lora_a, self.lora_b_t,
                                                            self.scaling))

    def set(self, slot: int, weights: LoRALayerWeights | None) -> None:
        """Put an adapter's A, B and scaling in `slot` (None: zeros)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.scaling[slot] = 0.0
        if weights is not None:
            r = weights.rank
            self.lora_a[slot, :r] = weights.lora_a
            self.lora_b[slot, :, :r] = weights.lora_b
            self.scaling[slot] = weights.scaling


class LinearWithLoRA:
    """base(x) + each token's adapter's change: x (T, in) -> (T, out)."""

    def __init__(self, base, slots: LoRASlots, punica: PunicaWrapper):
        self.base, self.slots, self.punica = base, slots, punica

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # (T, out): one product for the whole batch
        self.punica.add_lora_linear(y, x, self.slots.lora_a, self.slots.lora_b,
                                   self.slots.scaling)
        return y


class MergedLinearWithLoRA:
    """A fused product's outputs, each slice with its adapters' change."""

    def __init__(self, base, slots: list[LoRASlots], punica: PunicaWrapper):
        self.base, self.slots, self.punica = base, slots, punica

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = self.base(x)  # views of one (T, sum of outs) product
        for y, slots in zip(outputs, self.slots):
            self.punica.add_lora_linear(y, x, slots.lora_a, slots.lora_b, slots.scaling)
        return outputs
