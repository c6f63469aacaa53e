"""Adapters on the card and in memory (ch10; vLLM's LoRAModelManager and
LRUCacheWorkerLoRAManager).

Three places an adapter can be, from the cheapest to reach to the dearest:

- a slot (`--max-loras`): its weights in the stacked tensors the products
  read (common/lora/layers.py). Only requests whose adapter has a slot can
  run in a step: the scheduler admits at most max_loras distinct adapters;
- the memory cache (`--max-cpu-loras`): loaded from disk, ready to be
  copied into a slot; the least recently used leaves first;
- the disk: the folder peft saved, read again when it is needed.

`LoRAModelManager.wrap` puts LoRA slots beside a Llama-family forward
pass's products (common/models/llama.py: q/k/v and gate/up fused, o_proj,
down_proj). Before each step, `set_active_adapters` gives the step's
adapters slots (freeing the slots of adapters the step does not use, the
least recently used first) and `set_mapping` tells the products which
token goes with which slot.

Left out: vLLM's "long context" LoRA, adapters for other model families,
pinned-memory copies to a GPU.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import replace
from functools import partial

import torch

from common.lora.layers import LinearWithLoRA, LoRASlots, MergedLinearWithLoRA
from common.lora.lora_model import LoRAModel
from common.lora.punica import NO_LORA
from common.lora.punica_wrapper import LoRAKernel, PunicaWrapper
from common.lora.request import LoRARequest
from common.lora.scheduler import LoRAScheduler
from common.memory import format_bytes

log = logging.getLogger("llm-course")

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


class LoRAModelManager:
    def __init__(self, forward, dtype: torch.dtype, card=None, *, max_loras: int,
                 max_lora_rank: int, max_cpu_loras: int,
                 kernel: LoRAKernel = LoRAKernel.STACKED):
        """`card`: where the slots are booked (common/memory.py's Card; the
        worker builds the manager before the KV cache takes the rest)."""
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras "
                             f"({max_loras})")
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras, self.dtype = max_cpu_loras, dtype
        if forward.hf.device.type == "cuda":  # the Triton kernels (common/lora/triton_ops.py)
            from common.lora.triton_ops import PunicaWrapperTriton
            self.punica = PunicaWrapperTriton()
        else:  # the CPU: the stacked products (or, `kernel`, another form)
            self.punica = PunicaWrapper(kernel)
        self.slot_ids: list[int | None] = [None] * max_loras  # lora_int_id in each slot
        self.slot_use: OrderedDict[int, None] = OrderedDict()  # slots, least recent first
        self.cpu_cache: OrderedDict[int, LoRAModel] = OrderedDict()  # id -> weights, LRU
        self.requests: dict[int, LoRARequest] = {}  # every adapter known, by id
        self.slots: dict[tuple[int, str], LoRASlots] = {}  # (layer, projection) -> stacks
        self.card = card
        self.wrap(forward)
        # the slots' memory on the card, filled or not: fixed once wrapped
        # (every step's snapshot reports it)
        self.slot_bytes = sum(stacks.nbytes for stacks in self.slots.values())
        log.info("LoRA slots: %s (%d adapters of rank up to %d, every projection)",
                 format_bytes(self.slot_bytes), max_loras, max_lora_rank)

    # --------------------------------------------------------- the model
    def wrap(self, forward) -> None:
        """Put slots beside every projection of `forward` (a LlamaForward)."""
        if any(f is None for f in forward.qkv + forward.gate_up):
            raise NotImplementedError("LoRA on quantized projections is left out")
        device = forward.hf.device
        for i, layer in enumerate(forward.layers):
            modules = {"q_proj": layer.self_attn.q_proj, "k_proj": layer.self_attn.k_proj,
                       "v_proj": layer.self_attn.v_proj, "o_proj": layer.self_attn.o_proj,
                       "gate_proj": layer.mlp.gate_proj, "up_proj": layer.mlp.up_proj,
                       "down_proj": layer.mlp.down_proj}
            for name, module in modules.items():
                self.slots[i, name] = LoRASlots(self.max_loras, self.max_lora_rank,
                                                module.in_features, module.out_features,
                                                self.dtype, device, self.card)
            forward.qkv[i] = MergedLinearWithLoRA(
                forward.qkv[i], [self.slots[i, n] for n in QKV], self.punica)
            forward.gate_up[i] = MergedLinearWithLoRA(
                forward.gate_up[i], [self.slots[i, n] for n in GATE_UP], self.punica)
            forward.o_proj[i] = LinearWithLoRA(forward.o_proj[i], self.slots[i, "o_proj"],
                                               self.punica)
            forward.down_proj[i] = LinearWithLoRA(forward.down_proj[i],
                                                  self.slots[i, "down_proj"], self.punica)

    # --------------------------------------------------- known adapters
    def add_adapter(self, request: LoRARequest | list) -> None:
        """Know an adapter, and load it now: a folder that cannot be served
        is refused here, not at its first request. Known already: nothing.
        A list: [name, id, path], as chapter 09's engine process receives it."""
        if isinstance(request, list):
            request = LoRARequest(*request)
        if self.requests.get(request.lora_int_id) == request:
            return
        self.requests[request.lora_int_id] = request
        try:
            self.load(request.lora_int_id)
        except Exception:
            del self.requests[request.lora_int_id]
            raise

    def remove_adapter(self, lora_int_id: int) -> None:
        self.requests.pop(lora_int_id, None)
        self.cpu_cache.pop(lora_int_id, None)
        if lora_int_id in self.slot_ids:
            slot = self.slot_ids.index(lora_int_id)
            self.fill_slot(slot, None)

    def load(self, lora_int_id: int) -> LoRAModel:
        """The adapter's weights, from the memory cache or from its folder."""
        if lora_int_id in self.cpu_cache:
            self.cpu_cache.move_to_end(lora_int_id)
            return self.cpu_cache[lora_int_id]
        request = self.requests[lora_int_id]
        model = LoRAModel.from_local_checkpoint(request.lora_path, lora_int_id,
                                                self.max_lora_rank, self.dtype)
        self.cpu_cache[lora_int_id] = model
        while len(self.cpu_cache) > self.max_cpu_loras:
            self.cpu_cache.popitem(last=False)  # the least recently used
        return model

    # ---------------------------------------------------------- a step
    def set_active_adapters(self, lora_ids: set[int]) -> dict[int, int]:
        """A slot for each adapter of the step: lora_int_id -> slot."""
        if len(lora_ids) > self.max_loras:
            raise RuntimeError(f"{len(lora_ids)} adapters in one step, max_loras is "
                               f"{self.max_loras}: the scheduler should not allow it")
        for lora_id in lora_ids:
            if lora_id not in self.slot_ids:
                self.fill_slot(self.free_slot(lora_ids), self.load(lora_id))
            slot = self.slot_ids.index(lora_id)
            self.slot_use.pop(slot, None)
            self.slot_use[slot] = None  # the most recent
        return {lora_id: self.slot_ids.index(lora_id) for lora_id in lora_ids}

    def free_slot(self, keep: set[int]) -> int:
        """An empty slot, or the least recently used one not needed now."""
        if None in self.slot_ids:
            return self.slot_ids.index(None)
        return next(slot for slot in self.slot_use if self.slot_ids[slot] not in keep)

    def fill_slot(self, slot: int, model: LoRAModel | None) -> None:
        for (layer, name), stacks in self.slots.items():
            stacks.set(slot, model.loras.get((layer, name)) if model else None)
        self.slot_ids[slot] = model.lora_int_id if model else None
        if model is None:
            self.slot_use.pop(slot, None)

    def prepare(self, token_lora_ids: list[int], device: torch.device) -> None:
        """Before a forward pass: the step's adapters in slots, each token's slot."""
        self.set_active_adapters(set(token_lora_ids) - {0})
        self.set_mapping(token_lora_ids, device)

    def set_mapping(self, token_lora_ids: list[int], device: torch.device) -> None:
        """Each token's adapter (0: none) -> its slot, for the products."""
        slots = {lora_id: self.slot_ids.index(lora_id) for lora_id in set(token_lora_ids) - {0}}
        indices = [slots.get(lora_id, NO_LORA) for lora_id in token_lora_ids]
        self.punica.update_metadata(torch.tensor(indices, dtype=torch.long, device=device))


def with_adapters(parts, config):
    """Chapter 10's parts (`--enable-lora`): the engine's `parts` with the
    adapter slots beside the model and the scheduler that keeps a step
    within them (an EngineParts, from common/engine/parts.py)."""
    max_cpu_loras = config.max_cpu_loras or config.max_loras
    return replace(parts,
                   scheduler_cls=partial(LoRAScheduler, max_loras=config.max_loras),
                   adapters_cls=partial(LoRAModelManager, max_loras=config.max_loras,
                                        max_lora_rank=config.max_lora_rank,
                                        max_cpu_loras=max_cpu_loras))
