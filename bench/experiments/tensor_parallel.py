"""Tensor parallelism measured (ch08): `--tensor-parallel-size 1` vs 3.

    python -m bench.experiments.tensor_parallel                  # TP=1 and TP=3, 32 x 64 tokens
    python -m bench.experiments.tensor_parallel --tp 1 3 --clients 8 --max-tokens 32

Each size is one in-process `LLMEngine` (rank 0 here, the other ranks in
worker processes it spawns) on the embedded model, float32, on the demo
card (`--card`, 1.1 GiB per rank). For each it records:

- per rank: the weights on its card, the KV blocks the rest of its card
  could hold, the blocks it keeps (the smallest over the ranks) and the
  bytes of one block on it; the totals over the ranks;
- the load: `--clients` requests at once, `--max-tokens` greedy tokens
  each (EOS ignored), the load test's prompts through the chat template:
  output tokens/s, steps, milliseconds per step;
- the all-reduces, counted by rank 0's collectives themselves: calls and
  bytes per step, next to the formula hidden x tokens x 4 bytes x (2 per
  layer + the embedding), and the seconds rank 0 waited in them.

Results: bench/results/DATE-HOST-tensor-parallel.{json,md}. The run waits
(up to `--wait-quiet` seconds) for the machine's load average to fall
below 1.5 first: the ranks share the cores with anything else running.

Left out: HTTP (see `make bench`), GPUs (on CUDA the same engine uses NCCL;
timing NCCL's asynchronous all-reduces needs CUDA events), other sizes of
the embedded model (9 heads and 3 KV heads allow 1 and 3 only).
"""
from __future__ import annotations

import argparse
import datetime
import json
import socket
import sys
import time

from bench.loadtest import prompt_messages
from bench.record import (
    add_quiet_run_args,
    bf16_words,
    machine,
    render_again,
    wait_for_quiet_machine,
)
from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.parts import assemble_engine
from common.worker.worker import RankReport
from common.loader import apply_chat_template, load_model
from common.memory import MiB
from common.sampling_params import SamplingParams


def rank_reports(engine: LLMEngine) -> list[RankReport]:
    return engine.workers.reports if engine.workers is not None else [engine.worker.report]


def run_load(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts at t=0, greedy, EOS ignored; figures of the whole run."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    comm = engine.worker.tp.stats
    steps, start = 0, time.perf_counter()
    comm_before = (comm.all_reduce_calls, comm.all_reduce_bytes, comm.all_reduce_seconds)
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    seconds = time.perf_counter() - start
    calls, nbytes, waited = (now - before for now, before in zip(
        (comm.all_reduce_calls, comm.all_reduce_bytes, comm.all_reduce_seconds), comm_before))
    return {"seconds": seconds, "steps": steps, "all_reduce_calls": calls,
            "all_reduce_bytes": nbytes, "all_reduce_seconds": waited,
            "gather_bytes": comm.gather_bytes}


def measure(tp: int, card_gb: float, prompts: list[list[int]], max_tokens: int) -> dict:
    config = EngineConfig(device="cpu", dtype="float32", device_memory_gb=card_gb,
                          max_num_seqs=max(len(prompts), 1), tensor_parallel_size=tp)
    start = time.perf_counter()
    engine = assemble_engine(config, log_interval_s=1e9)
    startup = time.perf_counter() - start
    try:
        cfg = engine.loaded.model.config
        reports = rank_reports(engine)
        run = run_load(engine, prompts, max_tokens)
        fed = engine.stats.prompt_tokens + engine.stats.generation_tokens - len(prompts)
        per_token = cfg.hidden_size * 4 * (2 * cfg.num_hidden_layers + 1)  # float32
        blocks = engine.block_manager.num_blocks
        return {
            "tp": tp, "startup_s": startup,
            "ranks": [{"rank": r.rank, "weights_mib": r.weight_bytes / MiB,
                       "room_blocks": r.room_blocks, "kv_blocks": r.num_blocks,
                       "block_kib": r.block_bytes / 1024,
                       "kv_mib": r.num_blocks * r.block_bytes / MiB} for r in reports],
            "weights_mib_total": sum(r.weight_bytes for r in reports) / MiB,
            "kv_blocks": blocks, "kv_tokens": blocks * engine.block_size,
            "kv_mib_total": sum(r.num_blocks * r.block_bytes for r in reports) / MiB,
            "requests": len(prompts), "max_tokens": max_tokens,
            "output_tokens_per_s": len(prompts) * max_tokens / run["seconds"],
            "ms_per_step": 1000 * run["seconds"] / run["steps"],
            "tokens_fed": fed,
            "all_reduce_bytes_formula": fed * per_token if tp > 1 else 0,
            "all_reduce_bytes_per_decode_step": len(prompts) * per_token if tp > 1 else 0,
            **run,
        }
    finally:
        engine.close()


def markdown(rec: dict) -> str:
    m, s = rec["machine"], rec["settings"]
    rows = rec["rows"]
    lines = [f"# Tensor parallelism on the CPU, {rec['date'][:10]}", "",
             f"Command: `{rec['command']}`. Embedded SmolLM2-135M-Instruct (30 layers, "
             f"hidden 576, 9 heads, 3 KV heads), float32, a {s['card_gb']} GiB card per "
             f"rank (simulated), {s['clients']} requests at once x {s['max_tokens']} greedy "
             f"tokens (EOS ignored), in-process engine, gloo. Machine: {m['cpu']}, "
             f"{m['cores']} cores ({bf16_words(m)}), torch {m['torch']}; load average "
             f"{rec['load_average_at_start']:.2f} at the start.", "",
             "## The cards", "",
             "| TP | rank | weights MiB | room for blocks | blocks kept | KiB a block | KV MiB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        for rank in r["ranks"]:
            lines.append(f"| {r['tp']} | {rank['rank']} | {rank['weights_mib']:.1f} | "
                         f"{rank['room_blocks']} | {rank['kv_blocks']} | "
                         f"{rank['block_kib']:.0f} | {rank['kv_mib']:.0f} |")
    lines += ["", "| TP | weights MiB, all ranks | KV blocks | KV tokens | KV MiB, all ranks |",
              "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tp']} | {r['weights_mib_total']:.1f} | {r['kv_blocks']} | "
                     f"{r['kv_tokens']} | {r['kv_mib_total']:.0f} |")
    lines += ["", "## The load", "",
              "| TP | output tok/s | steps | ms per step | all-reduces per step | "
              "MiB all-reduced per step (formula) | s waiting in all-reduces (share) |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        per_step = r["all_reduce_calls"] / r["steps"]
        mib = r["all_reduce_bytes"] / r["steps"] / MiB
        formula = r["all_reduce_bytes_formula"] / r["steps"] / MiB
        share = r["all_reduce_seconds"] / r["seconds"]
        lines.append(f"| {r['tp']} | {r['output_tokens_per_s']:.1f} | {r['steps']} | "
                     f"{r['ms_per_step']:.0f} | {per_step:.0f} | {mib:.2f} ({formula:.2f}) | "
                     f"{r['all_reduce_seconds']:.1f} ({100 * share:.0f} %) |")
    lines += ["", why(rec)]
    return "\n".join(lines) + "\n"


def why(rec: dict) -> str:
    """The explanation, with this run's numbers."""
    by_tp = {r["tp"]: r for r in rec["rows"]}
    if 1 not in by_tp or len(by_tp) < 2:
        return ""
    one = by_tp[1]
    tp, many = max(by_tp.items())
    cores = rec["machine"]["cores"]
    per_call_ms = 1000 * many["all_reduce_seconds"] / max(1, many["all_reduce_calls"])
    ratio = many["output_tokens_per_s"] / one["output_tokens_per_s"]
    verdict = "Speed: not here." if ratio < 1 else (
        "Speed: faster in this run, but do not trust it: the machine was busy (load "
        f"average {rec['load_average_at_start']:.1f}), which hurts TP=1's two OpenMP "
        "threads more than single-threaded ranks.")
    return "\n".join([
        "## Why", "",
        f"- **Memory: it works.** Each of the {tp} cards holds 1/{tp} of the weights "
        f"({many['ranks'][0]['weights_mib']:.0f} MiB instead of "
        f"{one['ranks'][0]['weights_mib']:.0f}) and 1/{tp} of every KV block "
        f"({many['ranks'][0]['block_kib']:.0f} KiB instead of "
        f"{one['ranks'][0]['block_kib']:.0f}), so the cache grows from {one['kv_blocks']} "
        f"to {many['kv_blocks']} blocks ({many['kv_blocks'] / one['kv_blocks']:.1f}x, more "
        f"than {tp}x because the weights shrink too).",
        f"- **{verdict}** {tp} processes share {cores} cores: each rank runs "
        f"{max(1, cores // tp)} thread where TP=1 ran {cores}, so there is no extra "
        "compute to split the work over, and one rank or another is always waiting for "
        "a core. Every step also has "
        f"{many['all_reduce_calls'] // max(1, many['steps'])} all-reduces (2 per layer + the "
        "embedding), each a synchronization point: gloo messages over localhost TCP, "
        "and no rank can go on before the slowest has arrived. Rank 0 spent "
        f"{many['all_reduce_seconds']:.0f} s of its {many['seconds']:.0f} s inside them "
        f"({per_call_ms:.1f} ms a call on average), for "
        f"{many['all_reduce_bytes'] / max(1, many['all_reduce_calls']) / 1024:.0f} KiB a call. "
        f"Result: {many['output_tokens_per_s']:.1f} output tok/s at TP={tp} against "
        f"{one['output_tokens_per_s']:.1f} at TP=1 ({ratio:.2f}x).",
        f"- **On GPUs** each rank has a card of its own: a decode step, bound by reading "
        f"the weights, reads 1/{tp} of them per card, and the "
        f"{many['all_reduce_bytes_per_decode_step'] / MiB:.1f} MiB all-reduced per decode "
        f"step of {many['requests']} sequences cross NVLink in microseconds (NCCL). That "
        "is where tensor parallelism pays: models too big for one card, and latency.",
    ]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--card", dest="card_gb", type=float, default=1.1)
    add_quiet_run_args(p)
    args = p.parse_args(argv)
    if args.render is not None:
        render_again(args.render, markdown)
        return 0
    load_average = wait_for_quiet_machine(args.wait_quiet, args.quiet_load)
    when = datetime.datetime.now()
    tokenizer = load_model("smollm2", "float32", "cpu").tokenizer  # for the prompts
    prompts = [apply_chat_template(tokenizer, prompt_messages(i)) for i in range(args.clients)]
    rows = []
    for tp in args.tp:
        print(f"TP={tp} ...", file=sys.stderr)
        rows.append(measure(tp, args.card_gb, prompts, args.max_tokens))
    command = "python -m bench.experiments.tensor_parallel" + (" " + " ".join(argv or sys.argv[1:])
                                                    if (argv or sys.argv[1:]) else "")
    rec = {"date": when.isoformat(timespec="seconds"), "command": command,
           "machine": machine(), "load_average_at_start": load_average,
           "settings": {"clients": args.clients, "max_tokens": args.max_tokens,
                        "card_gb": args.card_gb, "tp": args.tp}, "rows": rows}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{when:%Y-%m-%d}-{socket.gethostname()}-tensor-parallel"
    (args.out_dir / f"{stem}.json").write_text(json.dumps(rec, indent=1) + "\n")
    (args.out_dir / f"{stem}.md").write_text(markdown(rec))
    print(markdown(rec))
    print(f"wrote {args.out_dir / stem}.json and .md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
