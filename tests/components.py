"""The components the tests grade: the course's reference ones, or a
learner's from a chapter's `exercises/` folder.

This is the one switch of the exercises: `pytest --exercise 04` (what
`make exercise CH=04` runs) gives the tests chapter 04's exercise files in
place of the reference modules of `common/`. The engine takes these
components as arguments (`LLMEngine(block_manager_cls=..., scheduler_cls=...,
attention_ops=..., quant_ops=...)`, `Metrics(collector_cls=...,
latency_logger_cls=...)`, chapter 09's `Router(replicas, policy, ...)`,
chapter 10's `EngineParts(scheduler_cls=..., adapters_cls=...)`), so nothing
is patched: the tests build the engine with what they are given.
"""
from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType, SimpleNamespace

from common import autoregressive, memory
from common.core import block_manager, scheduler
from common.entrypoints import metrics, routing
from common.layers import attention, quantization, rejection_sampler, token_bitmask
from common.lora import punica, punica_wrapper
from common.lora import scheduler as lora_scheduler
from common.lora.model_manager import LoRAModelManager

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Exercise:
    chapter: str
    folder: str
    file: str  # in <folder>/exercises/
    names: tuple[str, ...]  # what the learner writes in it
    reference: str  # where the reference lives


EXERCISES = {
    "01": Exercise("01", "01-concepts", "autoregressive.py",
                   ("sample_next_token", "generate_without_cache"), "common/autoregressive.py"),
    "02": Exercise("02", "02-minimal-pytorch-inference", "memory.py",
                   ("kv_cache_shape", "kv_bytes_per_token", "static_cache_bytes"),
                   "common/memory.py"),
    "03": Exercise("03", "03-kv-cache", "attention.py",
                   ("store_kvcache", "paged_decode_attention", "paged_prefill_attention"),
                   "common/layers/attention.py"),
    "04": Exercise("04", "04-paged-attention", "block_manager.py",
                   ("BlockManager", "compute_block_hash"), "common/core/block_manager.py"),
    "05": Exercise("05", "05-continuous-batching", "scheduler.py",
                   ("ContinuousScheduler",), "common/core/scheduler.py"),
    "06": Exercise("06", "06-openai-server", "metrics.py",
                   ("EngineCollector", "LatencyStatLogger"), "common/entrypoints/metrics.py"),
    # chapter 07's two: structured outputs, speculative decoding
    "07a": Exercise("07a", "07-structured-and-speculative", "token_bitmask.py",
                    ("apply_token_bitmask",), "common/layers/token_bitmask.py"),
    "07b": Exercise("07b", "07-structured-and-speculative", "rejection_sampler.py",
                    ("rejection_sample",), "common/layers/rejection_sampler.py"),
    # chapter 08: int8 weight-only quantization of one linear layer
    "08": Exercise("08", "08-levers-and-the-real-vllm", "quantization.py",
                   ("quantize_int8", "int8_linear"), "common/layers/quantization.py"),
    # chapter 09: the router's prefix-aware policy, by consistent hashing
    "09": Exercise("09", "09-scale-out", "routing.py",
                   ("prefix_block_hashes", "HashRing", "PrefixAwarePolicy"),
                   "common/entrypoints/routing.py"),
    # chapter 10's two: the LoRA products of a mixed batch, the adapter budget
    "10a": Exercise("10a", "10-adapters", "punica.py",
                    ("bgmv_shrink", "bgmv_expand", "add_lora_gathered", "LoRAMapping"),
                    "common/lora/punica.py"),
    "10b": Exercise("10b", "10-adapters", "scheduler.py", ("LoRAScheduler",),
                    "common/lora/scheduler.py"),
}


@dataclass(frozen=True)
class Components:
    """What the graded tests build the engine and call functions with."""
    # ch01
    sample_next_token: object = autoregressive.sample_next_token
    generate_without_cache: object = autoregressive.generate_without_cache
    # ch02
    kv_cache_shape: object = memory.kv_cache_shape
    kv_bytes_per_token: object = memory.kv_bytes_per_token
    static_cache_bytes: object = memory.static_cache_bytes
    # ch03: the three attention operations, as one object
    attention_ops: object = attention.TorchOps
    # ch04
    BlockManager: type = block_manager.BlockManager
    block_manager_module: ModuleType = block_manager  # where compute_block_hash lives
    # ch05
    ContinuousScheduler: type = scheduler.ContinuousScheduler
    # ch06
    EngineCollector: type = metrics.EngineCollector
    LatencyStatLogger: type = metrics.LatencyStatLogger
    # ch07: structured outputs and speculative decoding
    apply_token_bitmask: object = token_bitmask.apply_token_bitmask
    rejection_sample: object = rejection_sampler.rejection_sample
    # ch08: int8 weight-only quantization; `quant_ops` is the engine's
    # (`LLMEngine(quant_ops=...)`), built from the two functions
    quantize_int8: object = quantization.quantize_int8
    int8_linear: object = quantization.int8_linear
    quant_ops: object = quantization.ReferenceQuantOps
    # ch09: the router's prefix-aware policy (the router and the other
    # policies stay the course's)
    prefix_block_hashes: object = routing.prefix_block_hashes
    HashRing: type = routing.HashRing
    PrefixAwarePolicy: type = routing.PrefixAwarePolicy
    # ch10: the gathered LoRA products and the step's mapping (the engine
    # runs them through `lora_manager_cls`, below), and the scheduler that
    # keeps a step within --max-loras adapters
    bgmv_shrink: object = punica.bgmv_shrink
    bgmv_expand: object = punica.bgmv_expand
    add_lora_gathered: object = punica.add_lora_gathered
    LoRAMapping: type = punica.LoRAMapping
    LoRAScheduler: type = lora_scheduler.LoRAScheduler
    exercise: str | None = field(default=None)


def int8_quant_ops(quantize_int8, int8_linear) -> SimpleNamespace:
    """Exercise 08's two functions as the engine's `quant_ops` (the
    interface of `ReferenceQuantOps`: `quantize` stores a weight, `linear`
    multiplies by it), for `--quantization int8` only."""
    def quantize(weight, scheme):
        if scheme is not quantization.QuantScheme.INT8:
            raise ValueError(f"exercise 08 quantizes to int8, not {scheme}")
        qweight, scales = quantize_int8(weight)
        return {"qweight": qweight, "scales": scales}

    def linear(x, layer):
        return int8_linear(x, layer.qweight, layer.scales, layer.bias)

    return SimpleNamespace(name="exercise 08 (int8: yours)", quantize=quantize, linear=linear)


class GatheredPunicaWrapper(punica_wrapper.PunicaWrapper):
    """The engine's `PunicaWrapper` with exercise 10a's mapping and gathered
    product in place of the course's stacked one: what every LoRA layer of
    the model calls (common/lora/layers.py)."""

    def __init__(self, mapping_cls: type, add_lora_gathered):
        super().__init__(punica_wrapper.LoRAKernel.GATHERED)
        self.mapping_cls, self.add_lora_gathered = mapping_cls, add_lora_gathered

    def update_metadata(self, token_lora_indices):
        self.mapping = self.mapping_cls.from_indices(token_lora_indices)

    def add_lora_linear(self, y, x, lora_a, lora_b, scaling) -> None:
        if self.mapping.groups:  # none: no token of the step has an adapter
            self.add_lora_gathered(y, x, lora_a, lora_b, scaling,
                                   self.mapping.token_lora_indices)


def lora_manager_cls(impl: "Components") -> type:
    """The course's `LoRAModelManager` (slots, loading, the step's
    mapping), its products `impl`'s: a class to give the engine as
    `EngineParts(adapters_cls=partial(cls, max_loras=..., ...))`."""
    class ExerciseLoRAModelManager(LoRAModelManager):
        def wrap(self, forward) -> None:
            # before the layers are wrapped: they all keep this one wrapper
            self.punica = GatheredPunicaWrapper(impl.LoRAMapping, impl.add_lora_gathered)
            super().wrap(forward)

    return ExerciseLoRAModelManager


@dataclass(frozen=True)
class Hint:
    number: int
    title: str
    readme: str  # relative to the repository


def readme_path(chapter: str) -> Path:
    """The exercise's README: 07b's is README-07b.md beside 07a's."""
    folder = ROOT / EXERCISES[chapter].folder / "exercises"
    own = folder / f"README-{chapter}.md"
    return own if own.exists() else folder / "README.md"


def hint_for(chapter: str, test_name: str) -> Hint | None:
    """The hint a learner failing `test_name` should read first: the
    `hint` column of the README's grading table, then that hint's heading
    (`### N. title`). None if the README does not say."""
    readme = readme_path(chapter)
    lines = readme.read_text().splitlines()
    number = None
    column = None
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|"):
            column = None
            continue
        if "hint" in cells:
            column = cells.index("hint")
        elif column is not None and re.search(rf"\b{re.escape(test_name)}\b", cells[0]):
            found = re.search(r"\d+", cells[column]) if column < len(cells) else None
            number = int(found.group()) if found else None
            break
    if number is None:
        return None
    for line in lines:
        heading = re.match(rf"###\s+{number}\.\s+(.*)", line)
        if heading:
            return Hint(number, heading.group(1).strip(), str(readme.relative_to(ROOT)))
    return None


def exercise_path(chapter: str) -> Path:
    ex = EXERCISES[chapter]
    return ROOT / ex.folder / "exercises" / ex.file


def load_exercise(chapter: str, path: Path | None = None) -> ModuleType:
    """Import a chapter's exercise file (or `path`, a file that stands in
    for it: a named bug, tests/named_bugs.py) as a module of its own."""
    path = path or exercise_path(chapter)
    name = f"exercise_{chapter}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module


def components_for(chapter: str | None, path: Path | None = None) -> Components:
    """The reference components, with one chapter's replaced by the learner's
    (from `path` instead of the exercise file, if given)."""
    if chapter is None:
        return Components()
    module = load_exercise(chapter, path)
    learner = {name: getattr(module, name) for name in EXERCISES[chapter].names}
    if chapter == "03":
        return replace(Components(), exercise=chapter,
                       attention_ops=SimpleNamespace(**learner))
    if chapter == "04":
        return replace(Components(), exercise=chapter, BlockManager=learner["BlockManager"],
                       block_manager_module=module)
    if chapter == "08":
        return replace(Components(), exercise=chapter, **learner,
                       quant_ops=int8_quant_ops(**learner))
    return replace(Components(), exercise=chapter, **learner)
