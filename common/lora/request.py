"""LoRARequest (ch10): which adapter a request runs with, as vLLM names it.

A request without one runs the base model. The engine knows an adapter by
its `lora_int_id` (unique, at least 1: 0 would be "no adapter"); the API by
its `lora_name`, the `model` a client asks for; `lora_path` is the folder
peft saved it to (adapter_config.json and adapter_model.safetensors).

Left out: vLLM's `base_model_name` checks, `load_inplace` reloading.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError("lora_path cannot be empty")
