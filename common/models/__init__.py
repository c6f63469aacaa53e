"""Our own forward passes (ch03): the weights stay in the HF model."""
from __future__ import annotations


def build_forward(hf_model):
    """The forward pass for this HF model's family."""
    model_type = hf_model.config.model_type
    if model_type in ("llama", "qwen2", "mistral"):
        from common.models.llama import LlamaForward
        return LlamaForward(hf_model)
    if model_type == "gpt2":
        from common.models.gpt2 import GPT2Forward
        return GPT2Forward(hf_model)
    raise NotImplementedError(
        f"no forward pass for model_type={model_type!r}: chapters 03+ cover "
        "llama, qwen2, mistral and gpt2 (chapters 01-02 run any model)")
