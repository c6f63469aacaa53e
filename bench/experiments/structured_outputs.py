"""Structured outputs, measured (ch07): compile times, and what a grammar costs a step.

    python -m bench.experiments.structured_outputs                 # float32, 32 sequences
    python -m bench.experiments.structured_outputs --dtype bfloat16 --seqs 64

In process (no HTTP), on the embedded model:

1. compile times: xgrammar's `TokenizerInfo` for the vocabulary (once per
   engine), then each schema below compiled cold, and again (a cache hit:
   what every later request with the same schema pays);
2. the cost per step: `--seqs` greedy requests decode together, first
   free (EOS ignored, `--max-tokens`), then each under a JSON schema. For
   every step where all of them run, it records the step's time and, by
   wrapping the engine's functions, the grammar's part of it: filling and
   applying the bitmask (`StructuredOutputManager.apply`) and advancing
   each matcher (`StructuredOutputGrammar.accept_token`).

Results: bench/results/DATE-HOST-structured-outputs.{json,md}: medians,
and the constrained step against the free one, measured in the same run.

Left out: the served figures (the HTTP layer adds the same to both).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import statistics
import sys
import time
from pathlib import Path

import xgrammar as xgr

from bench.record import bf16_words, machine, write_results
from bench.loadtest import PROMPTS, ROOT
from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.parts import EngineParts, assemble_engine
from common.structured_output.manager import StructuredOutputGrammar, StructuredOutputManager
from common.loader import apply_chat_template, load_model
from common.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMAS = {
    "enum": {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}},
             "required": ["answer"]},
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"}},
        "required": ["name", "age"]},
    "nested_list": {"type": "object", "properties": {
        "title": {"type": "string"},
        "items": {"type": "array", "maxItems": 20, "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}},
            "required": ["name", "quantity"]}}},
        "required": ["title", "items"]},
}
# The per-step loads: a long answer (at least 40 strings), the strings free
# or bounded. A bound makes the mask depend on how many characters are left:
# xgrammar can precompute less of it, and filling a row costs more.
STEP_SCHEMAS = {
    "40+ strings": {"type": "object", "properties": {"words": {"type": "array", "items": {
        "type": "string"}, "minItems": 40}}, "required": ["words"]},
    "40+ strings of at most 12 characters": {"type": "object", "properties": {"words": {
        "type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 40}},
        "required": ["words"]},
}


def compile_times(loaded) -> dict:
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(loaded.tokenizer,
                                              vocab_size=loaded.model.config.vocab_size)
    times = {"tokenizer_info_s": time.perf_counter() - start, "schemas": {}}
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    for name, schema in SCHEMAS.items():
        text = json.dumps(schema)
        start = time.perf_counter()
        compiler.compile_json_schema(text)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        compiler.compile_json_schema(text)
        times["schemas"][name] = {"cold_s": cold, "cached_s": time.perf_counter() - start}
    return times


class GrammarClock:
    """Wall time spent in the grammar's functions, reset every step."""

    def __init__(self, engine: LLMEngine):
        self.seconds = 0.0
        manager = engine.structured_output  # the model runner's grammar logits step
        manager.apply = self.timed(manager.apply)
        self.accept = StructuredOutputGrammar.accept_token
        StructuredOutputGrammar.accept_token = self.timed(self.accept)

    def timed(self, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return wrapper

    def restore(self) -> None:
        StructuredOutputGrammar.accept_token = self.accept


def step_times(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
               num_seqs: int) -> dict:
    """Run the requests; the time of each step where all `num_seqs` decode,
    and the grammar's part of it."""
    clock = GrammarClock(engine)
    for i in range(num_seqs):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompts[i % len(prompts)], params)
    steps, grammar = [], []
    try:
        while engine.has_unfinished_requests():
            full = len(engine.scheduler.running) == num_seqs and all(
                s.num_computed_tokens == s.num_tokens - 1 for s in engine.scheduler.running)
            clock.seconds = 0.0
            start = time.perf_counter()
            engine.step()
            if full:
                steps.append(time.perf_counter() - start)
                grammar.append(clock.seconds)
    finally:
        clock.restore()
    return {"steps": len(steps), "step_ms": 1e3 * statistics.median(steps),
            "grammar_ms": 1e3 * statistics.median(grammar)}


def markdown(rec: dict) -> str:
    m, c = rec["machine"], rec["compile"]
    lines = ["# Structured outputs: compile times and the cost per step", "",
             f"Measured {rec['date']} on {m['cpu']} ({m['cores']} cores, {bf16_words(m)}), "
             f"{rec['dtype']}, `{rec['command']}`; xgrammar {rec['xgrammar']}.", "",
             f"xgrammar's TokenizerInfo for the 49,152-token vocabulary: "
             f"{c['tokenizer_info_s'] * 1e3:.0f} ms (once per engine).", "",
             "| schema | first compile | again (cache hit) |", "|---|---|---|"]
    for name, t in c["schemas"].items():
        lines.append(f"| {name} | {t['cold_s'] * 1e3:.1f} ms | {t['cached_s'] * 1e3:.3f} ms |")
    free = rec["free"]
    lines += ["", f"A decode step of {rec['seqs']} sequences, greedy (median over the steps "
              "where all of them decode; the grammar's part: filling and applying the masks, "
              "advancing the matchers):", "",
              "| rows | steps | step | of which grammar | step / free step |",
              "|---|---|---|---|---|",
              f"| free | {free['steps']} | {free['step_ms']:.1f} ms | "
              f"{free['grammar_ms']:.2f} ms | 1.00x |"]
    for name, con in rec["constrained"].items():
        lines.append(f"| JSON schema: {name} | {con['steps']} | {con['step_ms']:.1f} ms | "
                     f"{con['grammar_ms']:.2f} ms | **{con['step_ms'] / free['step_ms']:.2f}x** |")
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    loaded = load_model("smollm2", dtype=args.dtype, device="cpu")
    engine = assemble_engine(EngineConfig(dtype=args.dtype, device_memory_gb=2.0,
                                          enable_prefix_caching=True),
                             EngineParts(structured_output_cls=StructuredOutputManager),
                             loaded=loaded)
    prompts = [apply_chat_template(loaded.tokenizer, [{"role": "user", "content":
               f"{q} Answer with a JSON list of at least 40 words."}]) for q in PROMPTS]
    step_times(engine, prompts, SamplingParams(temperature=0, max_tokens=8), args.seqs)  # warm
    free = step_times(engine, prompts, SamplingParams(
        temperature=0, max_tokens=args.max_tokens, ignore_eos=True), args.seqs)
    constrained = {}
    for name, schema in STEP_SCHEMAS.items():
        grammar = StructuredOutputsParams(json=schema)
        engine.compile_grammar(grammar)
        constrained[name] = step_times(engine, prompts, SamplingParams(
            temperature=0, max_tokens=args.max_tokens, structured_outputs=grammar), args.seqs)
    rec = {"date": str(datetime.date.today()), "machine": machine(), "dtype": args.dtype,
           "seqs": args.seqs, "xgrammar": importlib.metadata.version("xgrammar"), "compile": compile_times(loaded),
           "free": free, "constrained": constrained,
           "command": "python -m bench.experiments.structured_outputs" + (f" {' '.join(argv)}" if argv else "")}
    write_results(args.out_dir, "structured-outputs", rec, markdown(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
