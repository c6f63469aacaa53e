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
