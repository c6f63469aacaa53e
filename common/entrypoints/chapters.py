"""Which chapter adds which flag and request field: one table, every server reads it.

Each chapter's server is the course up to that chapter, no further: a
flag or a request field that a later chapter adds is refused, never
silently ignored, and the refusal names the chapter to read next:

    $ python 05-continuous-batching/server.py --speculative-config '{...}'
    error: --speculative-config is not implemented in chapter 05: chapter 07 adds it

    POST /v1/chat/completions {"response_format": {"type": "json_object"}, ...}
    400 `response_format` is not implemented in chapter 06: chapter 07 adds it.

A flag is refused at start (exit 2, argparse's usage error, before the
model loads) when it is set to anything but its default: left at the
default it changes nothing. A later chapter's flags are also hidden from
the chapter's `--help`. A field is refused with a 400 naming it, when it
is set to anything but its default.

Not in the table: what every chapter takes (`--model`, `--dtype`,
`--max-model-len`, the card's flags), and `--max-num-seqs` and
`--max-num-batched-tokens`, which `make bench` passes to every chapter
alike (chapters 01-02 have no scheduler for them to limit).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import fields
from pathlib import Path
from types import ModuleType

from pydantic import BaseModel

from common.config import EngineConfig
from common.entrypoints.middleware import APIError

ROOT = Path(__file__).resolve().parents[2]
CHAPTER_FOLDERS: dict[str, str] = {
    "01": "01-concepts", "02": "02-minimal-pytorch-inference", "03": "03-kv-cache",
    "04": "04-paged-attention", "05": "05-continuous-batching", "06": "06-openai-server",
    "07": "07-structured-and-speculative", "08": "08-levers-and-the-real-vllm",
    "09": "09-scale-out", "10": "10-adapters",
}

# The flags each chapter adds (those every chapter takes are not listed).
FLAG_CHAPTERS: dict[str, str] = {
    # the engine's step events: the live view, recordings, vLLM's KV events
    "--live-view": "03", "--record-events": "03", "--kv-events-config": "03",
    "--block-size": "04", "--enable-prefix-caching": "04",  # paged blocks, prefix reuse
    "--long-prefill-token-threshold": "05", "--enforce-eager": "05",  # the scheduler
    "--disable-cascade-attn": "05",
    "--api-key": "06", "--max-waiting": "06", "--disable-fastapi-docs": "06",  # the API
    "--enable-server-load-tracking": "06", "--enable-tokenizer-info-endpoint": "06",
    "--max-logprobs": "06", "--enable-prompt-tokens-details": "06",
    "--speculative-config": "07",  # n-gram speculative decoding
    "--quantization": "08", "--tensor-parallel-size": "08",  # the levers
    "--engine-core": "09", "--data-parallel-size": "09",  # scale out
    "--enable-lora": "10", "--lora-modules": "10", "--max-loras": "10",  # adapters
    "--max-lora-rank": "10", "--max-cpu-loras": "10",
}

# The request fields each chapter adds (chapter 01 takes messages,
# max_tokens, temperature, n, seed, ignore_eos).
FIELD_CHAPTERS: dict[str, str] = {
    # the engine's sampler (chapter 03)
    "top_p": "03", "stop": "03", "presence_penalty": "03", "frequency_penalty": "03",
    "logit_bias": "03", "top_k": "03", "min_p": "03", "repetition_penalty": "03",
    "min_tokens": "03", "stop_token_ids": "03", "logprobs": "03", "top_logprobs": "03",
    "return_token_ids": "03",
    "stream": "06", "stream_options": "06",  # server-sent events
    "length_penalty": "06",  # beam search at the front (`use_beam_search`: never on chat)
    "response_format": "07", "structured_outputs": "07",  # grammars
}


# Each chapter as the README"s table shows it: (name, what it adds, how to run it).
CHAPTER_SUMMARY: dict[str, tuple[str, str, str]] = {
    "01": ("concepts",
           "the autoregressive loop by hand, no cache; the OpenAI wire format and the HTTP edge",
           "make serve CH=01"),
    "02": ("the naive server",
           "`model.generate`, a thread per request, worst-case KV reservation, the card, the load test",
           "make serve CH=02 CARD=1.1"),
    "03": ("KV cache",
           "our forward pass, an explicit KV cache (one region per request), the engine's `step()`, a FIFO queue, measured waste, the sampler's fields (stop, logprobs, penalties)",
           "make serve CH=03 CARD=1.1"),
    "04": ("paged attention",
           "blocks of 16 tokens on demand, block tables, the paged kernels (Triton, C++), prefix caching, static batches",
           "make serve CH=04 CARD=1.1"),
    "05": ("continuous batching",
           "scheduling at every step, chunked prefill, preemption by recompute, the offline `LLM`",
           "make serve CH=05 CARD=1.1"),
    "06": ("the OpenAI server",
           "the whole API (streaming, `/v1/completions`, beam search), errors, `--api-key`, metrics, fairness",
           "make serve CH=06"),
    "07": ("structured and speculative",
           "structured outputs (xgrammar) and n-gram speculative decoding with the rejection sampler",
           "make serve CH=07"),
    "08": ("the levers and the real vLLM",
           "dtype, int8/int4 quantization, tensor parallelism, the CPU kernels, and the real vLLM beside the course",
           "make serve CH=08"),
    "09": ("scale out",
           "the engine core in its own process (ZeroMQ, msgpack), `--data-parallel-size`, a router over N servers (round robin, least loaded, prefix-aware by consistent hashing), replicas that fail, Ray",
           "make serve CH=09 DP=2"),
    "10": ("adapters",
           "many fine-tunes on one engine: LoRA slots beside every product, a batch that mixes adapters (the gathered and grouped products), the `--max-loras` budget, adapters by `model` name, loaded at run time",
           "make serve CH=10"),
}

# Which chapter each module of common/ belongs to: the first chapter whose
# server loads it. A chapter's server loads only its own and earlier
# chapters' modules (tests/test_import_budget.py; `python -m
# tests.check_imports` prints what each loads). The README's chapter table
# and each chapter README's "modules it adds" come from here too.
MODULE_CHAPTERS: dict[str, str] = {
    # 01: the loop by hand, and the HTTP edge every chapter shares
    "common": "01", "common.autoregressive": "01", "common.config": "01",
    "common.loader": "01", "common.sampling_params": "01",
    "common.context_length": "01", "common.entrypoints.request_checks": "01",
    "common.net": "01",
    "common.layers": "01", "common.layers.sampler": "01",
    "common.entrypoints": "01", "common.entrypoints.chapters": "01",
    "common.entrypoints.cli_args": "01", "common.entrypoints.launcher": "01",
    "common.entrypoints.middleware": "01", "common.entrypoints.protocol": "01",
    "common.entrypoints.responses": "01", "common.entrypoints.simple_app": "01",
    "common.entrypoints.strict": "01", "common.entrypoints.response_format": "01",
    # 02: the card
    "common.memory": "02",
    # 03: our forward pass, the KV cache, the engine and its step
    "common.models": "03", "common.models.llama": "03", "common.models.gpt2": "03",
    "common.layers.attention": "03", "common.layers.attention_selector": "03",
    "common.layers.logits": "03", "common.layers.cpu_gemm": "03",
    "common.layers.elementwise": "03", "common.layers.fused": "03",
    "common.layers.cpu_attention": "03", "common.layers.cpp_extensions": "03",
    "common.layers.cascade_attention": "03",  # ch05 cascades; the runner asks it from 03
    "common.layers.parallel": "03", "common.layers.quantization": "03",
    "common.core": "03", "common.core.sequence": "03", "common.core.block_manager": "03",
    "common.core.scheduler": "03",
    "common.worker": "03", "common.worker.kv_cache": "03",
    "common.worker.model_runner": "03", "common.worker.worker": "03",
    "common.worker.cuda_graphs": "03",
    "common.engine": "03", "common.engine.admission": "03", "common.engine.parts": "03",
    "common.engine.llm_engine": "03", "common.engine.output_processor": "03",
    "common.engine.detokenizer": "03", "common.engine.async_llm": "03",
    "common.metrics": "03", "common.metrics.observers": "03", "common.metrics.stats": "03",
    "common.metrics.step_events": "03", "common.metrics.kv_events": "03",
    "common.outputs": "03", "common.entrypoints.serving_engine": "03",
    "common.entrypoints.chat_server": "03", "common.entrypoints.serving_chat": "03",
    "common.entrypoints.live_view": "03",
    # 04: the paged kernels (Triton, on CUDA)
    "common.layers.triton_kernels": "04",
    # 05: the offline LLM
    "common.entrypoints.llm": "05",
    # 06: the OpenAI server
    "common.entrypoints.api_server": "06", "common.entrypoints.metrics": "06",
    "common.entrypoints.serving_completion": "06", "common.entrypoints.beam_search": "06",
    "common.entrypoints.serving_tokenization": "06", "common.entrypoints.vllm_routes": "06",
    # 07: structured outputs and speculative decoding
    "common.structured_output": "07", "common.structured_output.manager": "07",
    "common.layers.token_bitmask": "07",
    "common.spec_decode": "07", "common.spec_decode.speculative": "07",
    "common.spec_decode.ngram_proposer": "07", "common.layers.rejection_sampler": "07",
    # 08: the levers
    "common.layers.quant_kernels": "08", "common.worker.tp_workers": "08",
    # 09: scale out
    "common.engine.core": "09", "common.engine.core_client": "09",
    "common.engine.serial": "09",
    "common.entrypoints.router": "09",
    "common.entrypoints.routing": "09", "common.entrypoints.ray_replicas": "09",
    # 10: adapters
    "common.lora": "10", "common.lora.request": "10", "common.lora.lora_model": "10",
    "common.lora.punica": "10", "common.lora.layers": "10", "common.lora.scheduler": "10",
    "common.lora.model_manager": "10", "common.lora.triton_ops": "10",
    "common.lora.punica_wrapper": "10",
    "common.entrypoints.serving_models": "10",
}

# The libraries a chapter brings in (imported by no earlier chapter).
LIBRARY_CHAPTERS: dict[str, str] = {"xgrammar": "07", "zmq": "09", "msgpack": "09",
                                    "ray": "09"}


def module_chapter(name: str) -> str | None:
    """The chapter of a module of common/ or of a chapter library."""
    return MODULE_CHAPTERS.get(name) or LIBRARY_CHAPTERS.get(name)


def not_in_chapter(name: str, chapter: str, adds: str) -> str:
    """The refusal's words, for a flag (`--quantization`) or a field (`` `stream` ``)."""
    return f"{name} is not implemented in chapter {chapter}: chapter {adds} adds it"


def flag_dest(flag: str) -> str:
    """Where argparse (and EngineConfig) keeps a flag: `--speculative-config`
    -> `speculative_config`."""
    return flag.removeprefix("--").replace("-", "_")


def later_flags(chapter: str) -> dict[str, str]:
    return {flag: adds for flag, adds in FLAG_CHAPTERS.items() if adds > chapter}


def hide_later_flags(parser: argparse.ArgumentParser, chapter: str) -> None:
    """A chapter's `--help` shows only its own flags (the others still parse,
    to be refused by name)."""
    for flag in later_flags(chapter):
        action = parser._option_string_actions.get(flag)
        if action is not None:
            action.help = argparse.SUPPRESS


def refuse_later_flags(parser: argparse.ArgumentParser, args: argparse.Namespace,
                       chapter: str) -> None:
    """A usage error (exit 2) for a flag that a later chapter adds, set to
    anything but its default."""
    for flag, adds in later_flags(chapter).items():
        dest = flag_dest(flag)
        if hasattr(args, dest) and getattr(args, dest) != parser.get_default(dest):
            parser.error(not_in_chapter(flag, chapter, adds))


def refuse_later_fields(request: BaseModel | dict, chapter: str) -> None:
    """A 400 naming the first field, in the table's order, that a later
    chapter adds and the request sets to anything but its default. A dict
    (chapter 02's raw body) counts a field as set when it is present."""
    for name, adds in FIELD_CHAPTERS.items():
        if adds <= chapter:
            continue
        if isinstance(request, dict):
            given = name in request
        else:
            field = type(request).model_fields.get(name)
            given = field is not None and getattr(request, name) != field.default
        if given:
            raise APIError(400, not_in_chapter(f"`{name}`", chapter, adds) + ".", param=name)


# --------------------------------------------- each chapter's engine parts
def chapter_server(chapter: str) -> ModuleType:
    """Chapter `chapter`'s server.py as a module (imported once, not run:
    its `main` runs only as a script). Chapters 03-09 define
    `engine_parts(config)` there: the parts their engine is built from."""
    name = f"chapter_{chapter}_server"
    if name not in sys.modules:
        path = ROOT / CHAPTER_FOLDERS[chapter] / "server.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def refuse_later_engine_args(engine_args: dict, chapter: str) -> None:
    """The offline `LLM`'s engine arguments, by the flags' table: one that a
    later chapter adds (`speculative_config` for chapter 05) is a
    TypeError naming that chapter, never silently ignored."""
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    for flag, adds in later_flags(chapter).items():
        name = flag_dest(flag)
        if name in engine_args and engine_args[name] != defaults.get(name):
            raise TypeError(not_in_chapter(name, chapter, adds))
