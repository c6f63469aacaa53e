"""The levers of `vllm serve`, measured on one card (ch06): dtype,
`--quantization`, `--tensor-parallel-size`.

    python -m bench.experiments.levers          # float32, bfloat16, int8, int4 (+ reference), TP=3
    python -m bench.experiments.levers --levers float32 int4 --clients 8

Each lever is one engine built in this process (chapter 06's engine, no
HTTP) on the demo card (`--card`, 1.1 GiB), with the same load: the load
test's prompts through the chat template, `--clients` requests at once,
`--max-tokens` greedy tokens each with EOS ignored. For each it records:

- the weights on the card (per rank with tensor parallelism) and the KV
  blocks that the rest of the card holds, and how many of the load's
  sequences fit in them at once at full length;
- output tokens/s for the whole load (after a short warm-up load), and its
  ratio to float32 measured in the same run;
- quality against float32: greedy tokens identical to float32's (the
  share of tokens before the first difference, averaged over requests, and
  the share of whole completions identical), and perplexity on a fixed
  text shipped in the repo (bench/data/perplexity.txt, 870 words written
  for the course), computed through the HF model with the lever's weights.

Results: bench/results/DATE-HOST-levers.{json,md}.

Left out: HTTP and the scheduler's queueing (see `make bench` for those),
quality on a real task (perplexity and agreement are proxies), and
perplexity for tensor parallelism (its weights are float32's, split: the
test suite checks its tokens equal TP=1's exactly).
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import platform
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from bench.record import bf16_words, machine
from bench.loadtest import prompt_messages
from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.parts import assemble_engine
from common.layers.quantization import QuantScheme, ReferenceQuantOps, quantize_linears
from common.loader import (
    apply_chat_template,
    convert_embedded_model,
    load_model,
    model_dtype,
    pick_dtype,
)
from common.memory import MiB
from common.models import quantizable_linears
from common.sampling_params import SamplingParams
from common.worker.worker import quant_ops_for

# The quantized matmuls: PyTorch's packed CPU kernels (bfloat16 activations)
# by default; the reference dequantizes and multiplies in float32 (slow, exact).
QUANT_OPS = {"int4-reference": ReferenceQuantOps}
RUNS = itertools.count()  # request ids stay unique across an engine's loads
RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
TEXT = Path(__file__).resolve().parents[1] / "data" / "perplexity.txt"
LEVERS = {  # name -> engine flags on top of the defaults
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int4": {"dtype": "float32", "quantization": "int4"},
    "int4-reference": {"dtype": "float32", "quantization": "int4"},
    "tp3": {"dtype": "float32", "tensor_parallel_size": 3},
}


@dataclass
class Load:
    clients: int
    max_tokens: int
    card_gb: float


def lever_config(lever: str, load: Load) -> EngineConfig:
    return EngineConfig(device="cpu", device_memory_gb=load.card_gb,
                        max_num_seqs=max(load.clients, 1), enable_prefix_caching=False,
                        **LEVERS[lever])


def build_engine(lever: str, load: Load) -> LLMEngine:
    """The engine as a server builds it: its own copy of the model, whose
    plain weights it frees once packed (the card charges what it keeps)."""
    return assemble_engine(lever_config(lever, load), log_interval_s=1e9,
                           quant_ops=QUANT_OPS.get(lever))


def lever_model(lever: str, load: Load):
    """HF's model with the lever's weights (its dtype, its quantized
    linears), for the perplexity: a copy of its own, beside no engine."""
    config = lever_config(lever, load)
    loaded = load_model(config.model, config.dtype, config.device)
    if config.quantization:
        scheme = QuantScheme(config.quantization)
        ops = QUANT_OPS.get(lever) or quant_ops_for(torch.device(config.device))
        quantize_linears(loaded.model, quantizable_linears(loaded.model, scheme), scheme, ops)
    return loaded


def run_load(engine: LLMEngine, prompts: list[list[int]], max_tokens: int
             ) -> tuple[list[list[int]], float]:
    """All prompts at t=0, greedy, EOS ignored. Returns tokens per request and seconds."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    run = next(RUNS)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{run}-r{i}", ids, params)
    tokens: dict[str, list[int]] = {}
    with tqdm(total=len(prompts) * max_tokens, desc="  tokens", leave=False) as bar:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:  # FINAL_ONLY: one output per request
                    tokens[output.request_id] = output.outputs[0].token_ids
            bar.update(engine.stats.generation_tokens - bar.n)
    return [tokens[f"{run}-r{i}"] for i in range(len(prompts))], time.perf_counter() - start


@torch.inference_mode()
def perplexity(hf_model, tokenizer, window: int = 512) -> float:
    """exp(mean negative log-likelihood) of TEXT, in windows of `window` tokens."""
    ids = tokenizer(TEXT.read_text(), return_tensors="pt")["input_ids"][0]
    total_nll, total_tokens = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window + 1][None, :]  # (1, <= window + 1)
        logits = hf_model(chunk[:, :-1]).logits.float()  # (1, T, vocab)
        nll = torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum")
        total_nll += nll.item()
        total_tokens += chunk.shape[1] - 1
    return math.exp(total_nll / total_tokens)


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(mean share of tokens before the first difference, share identical)."""
    prefixes, identical = [], 0
    for mine, ref in zip(tokens, reference):
        same = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), len(ref))
        prefixes.append(same / len(ref))
        identical += mine == ref
    return sum(prefixes) / len(prefixes), identical / len(tokens)


def blocks_per_sequence(prompts: list[list[int]], max_tokens: int, block_size: int) -> float:
    return sum(-(-(len(p) + max_tokens) // block_size) for p in prompts) / len(prompts)


def measure(lever: str, load: Load, prompts: list[list[int]]) -> dict:
    engine = build_engine(lever, load)
    try:
        run_load(engine, prompts[:2], 4)  # warm-up, not counted: first calls pay for set-up
        tokens, seconds = run_load(engine, prompts, load.max_tokens)
        per_seq = blocks_per_sequence(prompts, load.max_tokens, engine.block_size)
        row = {
            "lever": lever, "flags": LEVERS[lever],
            "weights_mib": engine.worker.weight_bytes / MiB,
            "ranks": engine.config.tensor_parallel_size,
            "kv_blocks": engine.block_manager.num_blocks,
            "sequences_that_fit": int(engine.block_manager.num_blocks // per_seq),
            "output_tokens_per_s": len(prompts) * load.max_tokens / seconds,
            "seconds": seconds, "tokens": tokens,
        }
        return row
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()


def measure_perplexity(lever: str, load: Load, row: dict) -> None:
    """The lever's perplexity, after its engine is gone (TP's weights are
    float32's, split: none)."""
    if row["ranks"] == 1:
        loaded = lever_model(lever, load)
        row["perplexity"] = perplexity(loaded.model, loaded.tokenizer)


def add_comparisons(rows: list[dict]) -> None:
    base = next((r for r in rows if r["lever"] == "float32"), None)
    if base is None:
        return
    for row in rows:
        row["tokens_per_s_vs_float32"] = row["output_tokens_per_s"] / base["output_tokens_per_s"]
        row["kv_blocks_vs_float32"] = row["kv_blocks"] / base["kv_blocks"]
        row["agreement_prefix"], row["identical"] = agreement(row["tokens"], base["tokens"])


def markdown(rec: dict) -> str:
    s, m = rec["settings"], rec["machine"]
    lines = [f"# The levers on one card, {rec['date'][:10]}", "",
             f"Command: `{rec['command']}`. Embedded SmolLM2-135M-Instruct, card "
             f"{s['card_gb']} GiB (simulated), {s['clients']} requests at once x "
             f"{s['max_tokens']} greedy tokens (EOS ignored), in-process engine. "
             f"Machine: {m['cpu']}, {m['cores']} cores ({bf16_words(m)}), torch {m['torch']}; "
             f"`--dtype auto` picks {rec.get('dtype_auto', '(not recorded)')} here.", "",
             "| lever | weights MiB (per rank) | KV blocks (x float32) | sequences that fit "
             "| output tok/s (x float32) | tokens as float32 | completions as float32 "
             "| perplexity |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        ppl = f"{r['perplexity']:.3f}" if "perplexity" in r else "-"
        lines.append(
            f"| {r['lever']} | {r['weights_mib']:.0f} | {r['kv_blocks']} "
            f"({r.get('kv_blocks_vs_float32', 1):.2f}x) | {r['sequences_that_fit']} | "
            f"{r['output_tokens_per_s']:.1f} ({r.get('tokens_per_s_vs_float32', 1):.2f}x) | "
            f"{100 * r.get('agreement_prefix', 1):.1f} % | {100 * r.get('identical', 1):.0f} % "
            f"| {ppl} |")
    lines += ["", "Tokens as float32: share of each completion's tokens before its first "
              "difference from float32's, averaged. Perplexity: bench/data/perplexity.txt "
              "through the HF model with the lever's weights."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levers", nargs="+", choices=list(LEVERS), default=list(LEVERS))
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--card", dest="card_gb", type=float, default=1.1)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    load = Load(args.clients, args.max_tokens, args.card_gb)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(convert_embedded_model())  # no model needed
    prompts = [apply_chat_template(tokenizer, prompt_messages(i)) for i in range(load.clients)]
    rows = []
    for lever in args.levers:
        print(f"[levers] {lever}: {LEVERS[lever]}", flush=True)
        rows.append(measure(lever, load, prompts))
        measure_perplexity(lever, load, rows[-1])
        print(f"[levers]   {rows[-1]['output_tokens_per_s']:.1f} tok/s, "
              f"{rows[-1]['kv_blocks']} blocks", flush=True)
    add_comparisons(rows)
    when = datetime.datetime.now()
    rec = {"date": when.isoformat(timespec="seconds"),
           "command": " ".join(["python -m bench.experiments.levers", *(argv if argv is not None
                                                              else sys.argv[1:])]),
           "settings": vars(load), "machine": machine(), "rows": rows,
           "dtype_auto": str(pick_dtype("auto", torch.device("cpu"),
                                        model_dtype("smollm2"))).removeprefix("torch.")}
    stem = f"{when:%Y-%m-%d}-{socket.gethostname() or platform.node()}-levers"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{stem}.json").write_text(json.dumps(rec, indent=1))
    (args.out_dir / f"{stem}.md").write_text(markdown(rec))
    print(markdown(rec))
    print(f"[levers] wrote {args.out_dir / stem}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
