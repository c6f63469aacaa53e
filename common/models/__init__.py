"""Our own forward passes (ch03): the weights stay in the HF model.

What depends on the model's family lives here, not in common/layers/:
which forward pass runs it, whether it can be split over ranks (ch08,
`check_tensor_parallel`) or quantized (`check_quantization`), and which
of its matrices are cut or quantized (`shard_for_rank`,
`quantizable_linears`, from each family's module).
"""
from __future__ import annotations

from common.config import ConfigError
from common.layers.quantization import QuantScheme

# The model types that LlamaForward runs (and that --quantization and
# --tensor-parallel-size cover, ch08).
LLAMA_FAMILY = ("llama", "qwen2", "mistral")


def build_forward(hf_model, attention_ops=None, tp=None):
    """The forward pass for this HF model's family. `attention_ops`: see
    common.layers.attention.paged_attention (default: picked for the device).
    `tp` (ch08): this rank's `TPGroup` when the model is split over ranks
    (Llama family only; common/layers/parallel.py)."""
    model_type = hf_model.config.model_type
    if model_type in LLAMA_FAMILY:
        from common.models.llama import LlamaForward
        if tp is not None:
            return LlamaForward(hf_model, attention_ops, tp)  # ch08
        return LlamaForward(hf_model, attention_ops)
    if tp is not None and tp.is_parallel:
        raise NotImplementedError("tensor parallelism covers the Llama family")
    if model_type == "gpt2":
        from common.models.gpt2 import GPT2Forward
        return GPT2Forward(hf_model, attention_ops)
    raise NotImplementedError(
        f"no forward pass for model_type={model_type!r}: chapters 03+ cover "
        "llama, qwen2, mistral and gpt2 (chapters 01-02 run any model)")


def check_tensor_parallel(hf_config, world_size: int,
                          quantization: QuantScheme | str | None = None) -> None:
    """Refuse, at startup and with vLLM's wording, a model that cannot be
    split in `world_size` equal parts."""
    if world_size < 1:
        raise ConfigError(f"--tensor-parallel-size must be at least 1, got {world_size}.")
    if world_size == 1:
        return
    if hf_config.model_type not in LLAMA_FAMILY:
        raise ConfigError(
            f"tensor parallelism covers the Llama family ({', '.join(LLAMA_FAMILY)}), "
            f"not model_type={hf_config.model_type!r}: use --tensor-parallel-size 1.")
    if quantization is not None:
        raise ConfigError(
            f"--quantization {quantization} and --tensor-parallel-size {world_size} are "
            "not combined in this course: use one or the other.")
    problems = []
    for what, total in (("attention heads", hf_config.num_attention_heads),
                        ("key-value heads", hf_config.num_key_value_heads),
                        ("intermediate features", hf_config.intermediate_size)):
        if total % world_size:
            problems.append(f"Total number of {what} ({total}) must be divisible by "
                            f"tensor parallel size ({world_size}).")
    if problems:
        heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
        fits = [n for n in range(1, heads[1] + 1) if heads[0] % n == 0 and heads[1] % n == 0
                and hf_config.intermediate_size % n == 0]
        raise ConfigError(" ".join(problems) + f" Sizes that fit this model: "
                          f"{', '.join(map(str, fits))}.")


def check_quantization(config, scheme: QuantScheme | None) -> None:
    """Refuse, with a clear message, a model the course cannot quantize."""
    if scheme is None:
        return
    if config.model_type not in LLAMA_FAMILY:
        raise ConfigError(f"--quantization {scheme} covers the Llama family "
                          f"({', '.join(LLAMA_FAMILY)}), not model_type={config.model_type!r}")


def shard_for_rank(hf_model, rank: int, world_size: int) -> None:
    """Keep rank `rank`'s share of the model's weights (ch08), in place."""
    from common.models.llama import shard_llama_for_rank  # the Llama family only
    shard_llama_for_rank(hf_model, rank, world_size)


def quantizable_linears(hf_model, scheme: QuantScheme) -> list[str]:
    """The paths of the linear layers `--quantization scheme` swaps (ch08)."""
    check_quantization(hf_model.config, scheme)
    from common.models.llama import quantizable_linears as llama_linears
    return llama_linears(hf_model)
