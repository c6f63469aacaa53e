"""An adapter's weights, read from the folder peft saved (ch10; vLLM's lora_model.py).

LoRA (Hu et al., 2021, arXiv:2106.09685) fine-tunes a linear layer
`y = x W^T` by learning a low-rank change of it, `W + scaling * B A`, with
A: (r, in) and B: (out, r), r a few dozen at most against in and out in
the hundreds or thousands, and scaling = lora_alpha / r. peft saves, for
every adapted projection of every layer, two tensors:

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   (r, in)
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   (out, r)

and adapter_config.json: r, lora_alpha, target_modules, use_rslora
(scaling = lora_alpha / sqrt(r) instead).

Left out: adapters of the embedding or the LM head (`modules_to_save`),
DoRA, biases (`bias` other than "none"), pickled `.bin` checkpoints.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

# The projections of a Llama-family decoder layer an adapter may change.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRALoadError(ValueError):
    """An adapter folder that cannot be served: said with vLLM's words."""


@dataclass
class LoRALayerWeights:
    """One projection's change: delta(x) = scaling * (x @ lora_a^T) @ lora_b^T."""
    lora_a: torch.Tensor  # (r, in)
    lora_b: torch.Tensor  # (out, r)
    scaling: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass
class LoRAModel:
    """One adapter: its id and, per (layer index, projection), its weights."""
    lora_int_id: int
    rank: int
    loras: dict[tuple[int, str], LoRALayerWeights]

    @classmethod
    def from_local_checkpoint(cls, path: str | Path, lora_int_id: int, max_lora_rank: int,
                              dtype: torch.dtype = torch.float32) -> "LoRAModel":
        folder = Path(path)
        config_file = folder / "adapter_config.json"
        weights_file = folder / "adapter_model.safetensors"
        if not config_file.is_file() or not weights_file.is_file():
            raise LoRALoadError(f"No adapter found for {path}: adapter_config.json and "
                                "adapter_model.safetensors are needed")
        config = json.loads(config_file.read_text())
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
        if rank > max_lora_rank:
            raise LoRALoadError(f"LoRA rank {rank} is greater than max_lora_rank "
                                f"{max_lora_rank}.")
        unexpected = set(target_modules(config)) - set(LORA_TARGETS)
        if unexpected:
            raise LoRALoadError(f"While loading {path}, expected target modules in "
                                f"{list(LORA_TARGETS)} but received {sorted(unexpected)}.")
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, tensor in load_file(weights_file).items():
            match = PEFT_KEY.search(key)
            if match is None:
                raise LoRALoadError(f"While loading {path}: unexpected weight {key}")
            layer, module, which = int(match[1]), match[2], match[3]
            pairs.setdefault((layer, module), {})[which] = tensor.to(dtype)
        loras = {where: LoRALayerWeights(ab["A"], ab["B"], scaling)
                 for where, ab in pairs.items()}
        return cls(lora_int_id, rank, loras)


def target_modules(config: dict) -> list[str]:
    """adapter_config.json's target_modules: a list, or one regular expression."""
    targets = config.get("target_modules") or []
    if isinstance(targets, str):  # a regex over module paths: keep the names it matches
        return [name for name in LORA_TARGETS if re.search(targets, f"layers.0.x.{name}")]
    return list(targets)
