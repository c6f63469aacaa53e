"""The LoRA layers' one entry point: which form of the products a step runs (ch10;
vLLM's PunicaWrapperCPU, vllm/lora/punica_wrapper/).

Every LoRA layer of the model (common/lora/layers.py) holds the same
`PunicaWrapper` and calls `add_lora_linear(y, x, lora_a, lora_b,
scaling)`; the model runner gives it each step's token-to-slot mapping
first (`update_metadata`). It runs one of three equal forms
(`LoRAKernel`): the gathered and the grouped ones of common/lora/punica.py,
or the stacked one written here, the engine's on the CPU:

- stacked, every slot at once: x against all the slots' A as one
  (slots * r, in) matrix, each row keeping only its own slot's r columns
  (the others multiplied by 0), then against all the B as one
  (slots * r, out) matrix: two products for the batch whatever the
  adapters, where the grouped form runs five small operations per slot.
  It does `slots` times the arithmetic of one adapter's products (at rank
  8, thin products still) and reads every slot's weights up to the last
  slot the step uses (slots are filled from the first: a step of one
  adapter usually reads one).

On CUDA the model manager takes the Triton kernels' wrapper instead
(common/lora/triton_ops.py), with the same two methods.

Left out: vLLM's single shrink for the slices of a fused product (q, k, v
at once), its per-step metadata buffers kept for CUDA graphs.
"""
from __future__ import annotations

import enum

import torch

from common.lora.punica import LoRAMapping, add_lora_gathered, add_lora_grouped


def slot_onehot(indices: torch.Tensor, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """(T, slots): 1 where token t runs slot s; a NO_LORA row is all 0."""
    return (indices[:, None] == torch.arange(num_slots, device=indices.device)).to(dtype)


def add_lora_stacked(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                     lora_b: torch.Tensor, scaling: torch.Tensor,
                     onehot: torch.Tensor) -> None:
    """The same as `add_lora_gathered`, two products for the batch (module
    docstring). onehot: (T, slots), `slot_onehot`. lora_b (slots, out, r) is
    best the transposed view of a (slots, r, out) tensor (LoRASlots keeps
    it so): then all the B read as one matrix without a copy."""
    slots, rank, d_in = lora_a.shape
    h = x @ lora_a.reshape(slots * rank, d_in).T  # (T, slots * r): every slot's A x
    keep = (onehot * scaling)[:, :, None]  # (T, slots, 1): its own slot's alpha / r, else 0
    h = (h.view(-1, slots, rank) * keep).view(-1, slots * rank)
    y.addmm_(h, lora_b.transpose(1, 2).reshape(slots * rank, -1))  # += (T, r*s) @ (r*s, out)


class LoRAKernel(enum.Enum):
    """Which of the three forms a PunicaWrapper runs (module docstring)."""
    GATHERED = "gathered"  # per token: the reference, exercise 10a's
    GROUPED = "grouped"  # per adapter, two small products each
    STACKED = "stacked"  # every slot at once: the engine's on the CPU


class PunicaWrapper:
    """The step's mapping, shared by every LoRA layer of the model (vLLM's
    PunicaWrapperCPU): the model runner sets it before each forward pass."""

    def __init__(self, kernel: LoRAKernel = LoRAKernel.STACKED):
        self.kernel = kernel
        self.mapping = LoRAMapping(torch.empty(0, dtype=torch.long))
        self.onehot: torch.Tensor | None = None  # the stacked form's, made at its first use
        self.num_slots = 0  # the stacked form's: slots 0 .. the last one the step uses

    def update_metadata(self, token_lora_indices: torch.Tensor) -> None:
        self.mapping = LoRAMapping.from_indices(token_lora_indices)
        self.onehot = None
        # the stacked form reads slots 0 .. the last one in use (a view, no copy)
        self.num_slots = 1 + max((slot for slot, _ in self.mapping.groups), default=-1)

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                        lora_b: torch.Tensor, scaling: torch.Tensor) -> None:
        """y (T, out) += each token's adapter's change of x (T, in), in place."""
        if not self.mapping.groups:
            return
        indices = self.mapping.token_lora_indices
        if self.kernel is LoRAKernel.STACKED:
            used = self.num_slots
            if self.onehot is None:  # once a step, for every layer
                self.onehot = slot_onehot(indices, used, x.dtype)
            add_lora_stacked(y, x, lora_a[:used], lora_b[:used], scaling[:used], self.onehot)
        elif self.kernel is LoRAKernel.GROUPED:
            add_lora_grouped(y, x, lora_a, lora_b, scaling, self.mapping)
        else:
            add_lora_gathered(y, x, lora_a, lora_b, scaling, indices)
