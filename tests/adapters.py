"""Seeded random LoRA adapters for the tests of chapter 10, made and saved
by peft itself, and the merged models they are checked against."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from common.lora.lora_model import LORA_TARGETS


def peft_adapter(base_model, folder: Path, rank: int, alpha: int, seed: int,
                 targets=LORA_TARGETS):
    """A seeded random adapter saved to `folder` (its A and B both random:
    `init_lora_weights=False`, B made larger so that greedy tokens show the
    change). Returns peft's merged model, the reference."""
    peft = pytest.importorskip("peft", reason="peft is in requirements.txt (make setup)")
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                             init_lora_weights=False)
    model = peft.get_peft_model(copy.deepcopy(base_model), config)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data *= 20
    model.save_pretrained(folder)
    return model.merge_and_unload().eval()


def lora_engine(loaded, impl, max_loras: int, max_lora_rank: int, **config):
    """An engine with chapter 10's adapter layer, built from `impl`
    (tests/components.py): its `LoRAScheduler` (exercise 10b) and its
    gathered products and mapping in every LoRA layer (exercise 10a);
    the course's slots and model manager around them."""
    from functools import partial

    from common.config import EngineConfig
    from common.engine.parts import EngineParts, assemble_engine
    from tests.components import lora_manager_cls
    config.setdefault("device_memory_gb", 2.0)
    engine_config = EngineConfig(enable_lora=True, max_loras=max_loras,
                                 max_lora_rank=max_lora_rank, **config)
    parts = EngineParts(
        scheduler_cls=partial(impl.LoRAScheduler, max_loras=max_loras),
        adapters_cls=partial(lora_manager_cls(impl), max_loras=max_loras,
                             max_lora_rank=max_lora_rank, max_cpu_loras=max_loras))
    return assemble_engine(engine_config, parts, loaded=loaded)
