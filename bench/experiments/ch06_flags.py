"""Chapter 06 against itself with other flags: a before/after pair, runs alternated.

    python -m bench.experiments.ch06_flags --loads long shared-prefix \\
        --after="--long-prefill-token-threshold 256" --after-name "half the budget"

Two chapter 06 servers on the same card, both up: "before" with
`--before` (default: none, the chapter's defaults) and "after" with
`--after`; then for each load of bench/workloads.py, before, after,
before, after ... (`--alternations` pairs), each run `--duration`
seconds of steady state, both runs of a pair on the same requests. The
same measurement as bench/vs_vllm.py (its `measure_run`: tokens/s,
TTFT, ITL, E2E, prefix-cache hits, the idle server's CPU), for a change
of flags rather than a change of server.

Results: bench/results/DATE-HOST-ch06-flags-LABEL.{json,md}.

Left out: code changes (check out the two versions in two worktrees and
start each with `--url`-style flags of its own: not here), other chapters.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

from bench.loadtest import ChapterServer
from bench.record import bf16_words, record_head, write_results
from bench.vs_vllm import (
    LATENCIES,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    alternated_runs,
    card_for_kv,
    medians,
    ratio_spread,
)
from bench.workloads import WORKLOADS
from common.net import free_port

SIDES = ("before", "after")


def start(flags: list[str], dtype: str, card_gb: float, log: Path) -> ChapterServer:
    return ChapterServer("06", free_port(), [
        "--dtype", dtype, "--device-memory-gb", str(card_gb), "--max-num-seqs",
        str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), *flags], log)


def measure_load(name: str, servers: dict[str, ChapterServer], args) -> dict:
    workload = WORKLOADS[name]
    _, runs = alternated_runs(workload, servers, args.seed, args.alternations,
                              args.duration or workload.duration_s)
    return {"load": name, "runs": runs, **ratio_spread(runs["after"], runs["before"]),
            **{side: medians(runs[side]) for side in SIDES}}


def markdown(rec: dict) -> str:
    m = rec["machine"]
    run_length = f"{rec['duration']:g} s" if rec["duration"] else "the load's own length"
    lines = [f"# Chapter 06, {rec['after_name']}: after against before", "",
             f"Measured {rec['date']} on {m['cpu']} ({m['cores']} cores, {bf16_words(m)}), "
             f"{rec['dtype']}; {rec['minutes']:.1f} min.",
             f"Command: `{rec['command']}`. Before: `{rec['before'] or '(the defaults)'}`; "
             f"after: `{rec['after'] or '(the defaults)'}`. Card {rec['card_gb']} GiB each, {rec['alternations']} "
             f"alternated pairs of runs, each {run_length} of steady state.", "",
             "| load | before tok/s | after tok/s | after / before (each pair) | median "
             "| TTFT p50 before / after s | ITL p50 before / after ms | prefix hits before / after |",
             "|---|---|---|---|---|---|---|---|"]
    for load in rec["loads"]:
        b, a = load["before"], load["after"]

        def hits(x):
            return "-" if x["prefix_cache_hit_rate"] is None else \
                f"{100 * x['prefix_cache_hit_rate']:.0f} %"
        lines.append(
            f"| {load['load']} | {b['output_tokens_per_s']:.1f} | {a['output_tokens_per_s']:.1f} "
            f"| {', '.join(f'{r:.2f}' for r in load['ratios'])} | **{load['ratio_median']:.2f}x** "
            f"| {b['ttft_p50_s']:.2f} / {a['ttft_p50_s']:.2f} "
            f"| {1e3 * b['itl_p50_s']:.0f} / {1e3 * a['itl_p50_s']:.0f} "
            f"| {hits(b)} / {hits(a)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default="", help="chapter 06's flags before (default: none)")
    p.add_argument("--after", required=True, help="chapter 06's flags after")
    p.add_argument("--after-name", required=True, help="the change, in words")
    p.add_argument("--label", required=True, help="ends the results files' names")
    p.add_argument("--loads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--alternations", type=int, default=2)
    p.add_argument("--duration", type=float, default=None,
                   help="s of steady state per run (default: each load's own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    begin, card = time.perf_counter(), card_for_kv(args.dtype)
    logs = Path(tempfile.mkdtemp(prefix="ch06-flags-"))
    servers = {}
    try:
        for side in SIDES:
            servers[side] = start(shlex.split(getattr(args, side)), args.dtype, card,
                                  logs / f"{side}.log")
        loads = [measure_load(name, servers, args) for name in args.loads]
    finally:
        for server in servers.values():
            server.stop()
    command = "python -m bench.experiments.ch06_flags " + shlex.join(argv or sys.argv[1:])
    rec = {**record_head(command), "before": args.before, "after": args.after,
           "after_name": args.after_name, "dtype": args.dtype, "card_gb": card,
           "alternations": args.alternations, "duration": args.duration, "loads": loads,
           "latencies": LATENCIES, "minutes": (time.perf_counter() - begin) / 60}
    write_results(args.out_dir, f"ch06-flags-{args.label}", rec, markdown(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
