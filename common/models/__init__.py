"""Our own forward passes (ch03): the weights stay in the HF model."""
from __future__ import annotations

import torch

# The model types that LlamaForward runs (and that --quantization and
# --tensor-parallel-size cover, ch06).
LLAMA_FAMILY = ("llama", "qwen2", "mistral")


def build_forward(hf_model, attention_ops=None, tp=None):
    """The forward pass for this HF model's family. `attention_ops`: see
    common.layers.attention.paged_attention (default: picked for the device).
    `tp` (ch06): this rank's `TPGroup` when the model is split over ranks
    (Llama family only; common/layers/parallel.py)."""
    model_type = hf_model.config.model_type
    if model_type in LLAMA_FAMILY:
        from common.models.llama import LlamaForward
        if tp is not None:
            return LlamaForward(hf_model, attention_ops, tp)  # ch06
        return LlamaForward(hf_model, attention_ops)
    if tp is not None and tp.is_parallel:
        raise NotImplementedError("tensor parallelism covers the Llama family")
    if model_type == "gpt2":
        from common.models.gpt2 import GPT2Forward
        return GPT2Forward(hf_model, attention_ops)
    raise NotImplementedError(
        f"no forward pass for model_type={model_type!r}: chapters 03+ cover "
        "llama, qwen2, mistral and gpt2 (chapters 01-02 run any model)")


def lm_head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden: (N, hidden), weight: (vocab, hidden) -> logits (N, vocab).

    F.linear(hidden, weight), written as weight @ hidden.T: the head is the
    largest matrix product of a decode step (49,152 x 576 for SmolLM2), and
    on the CPU the BLAS (MKL) is faster with the big matrix on the left,
    read in its own row order: a quarter faster at 32 rows, several times
    faster at 2-9 rows (measured on a 2-core AMD EPYC, torch 2.13).
    Same dot products; the sums may round differently in the last bits
    (as F.linear's own results already vary with the number of rows)."""
    return (weight @ hidden.T).T.contiguous()  # (vocab, N) -> (N, vocab)
