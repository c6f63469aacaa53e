"""`make bench-vs-vllm`: chapter 06 against the real vLLM, runs alternated.

    python -m bench.vs_vllm        # 5 loads x 2 dtypes x 3 pairs of 30-60 s runs (~60 min, 2 cores)
    python -m bench.vs_vllm --loads chat-32 long --dtypes float32 --alternations 1 --duration 10

One short run per server says little: the same vLLM moved by a quarter
from one run to the next (bench/README.md). So here, for each dtype,
both servers start once and stay up side by side:

- chapter 06's (`06-openai-server/server.py`), on a card that leaves it
  about vLLM's KV cache (`card_for_kv`: the KV cache, the weights and a
  step's activations, over the share of the card the engine uses);
- the real vLLM (bench/peers/vllm_peer.py), 1 GiB of KV cache, every core
  computing (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`);
- both with 64 sequences and 512 tokens per step.

Then for each load (bench/workloads.py): one uncounted warm-up request
to each, then chapter 06, vLLM, chapter 06, vLLM, ... (`--alternations`
pairs), each run `--duration` seconds of steady state (bench/loadtest.py
`run_for_duration`; by default each load's own: 30 s for chat, 60 s for
the long prompts, whose requests last about 30 s each). A pair's two runs send the same requests (one seed);
each pair has its own seed, so that no run finds the previous one's
documents in its prefix cache.

Reported for each load and dtype: each run's output tokens/s; chapter 06
over vLLM for each pair, their median and spread (min-max); TTFT, ITL
and E2E p50 and p95 of both servers (the median over the runs); the
prefix-cache hit rate and the preemptions (the servers' `/metrics`, vLLM's
names); the failures. And the check that the idle server takes no CPU
while the other is loaded: its process group's CPU seconds during each of
the other's runs (`group_cpu_seconds`, from /proc). bfloat16 runs only
where the CPU computes it (bench/record.py `bf16_words`).

Results: bench/results/DATE-HOST-vs-vllm[-LABEL].{json,md}, with the CPU,
its bf16 flags, the cards and KV caches, the servers' commands, and each
load's closest `vllm bench serve` command.

Left out: a run's ramp-up and drain stay in its wall time (vLLM's
definition of output tokens/s: a run's tokens over its wall time); the
servers are not pinned to cores; other peers (`make bench PEERS=llama-cpp`).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

import requests

from bench.loadtest import ChapterServer, ServerProcess, fetch_stats, served_model
from bench.peers import vllm_peer
from bench.record import (
    add_quiet_run_args,
    bf16_words,
    record_head,
    render_again,
    wait_for_quiet_machine,
    write_results,
)
from bench.scale import chat_turn, counter_totals
from bench.workloads import WORKLOADS, Client, Workload, run_workload
from common.config import EngineConfig
from common.loader import cpu_computes_bfloat16, load_model
from common.memory import GiB, activation_bytes_estimate, weight_bytes
from common.net import free_port

OURS, VLLM = "ch06", "vllm"
DTYPES = ["float32", "bfloat16"]
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 64, 512
KV_GB = vllm_peer.DEFAULT_KV_GB
WARMUP_SEED = 1000  # added to --seed: the warm-up's request is none of the runs'
COUNTERS = ["vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:num_preemptions"]
LATENCIES = ["ttft_p50_s", "ttft_p95_s", "itl_p50_s", "itl_p95_s", "e2e_p50_s", "e2e_p95_s"]
RUN_FIGURES = ["completed", "failed", "first_errors", "duration_s", "output_tokens",
               "output_tokens_per_s", "requests_per_s", "tpot_mean_s", *LATENCIES]


# ------------------------------------------------------------ the servers
def card_for_kv(dtype: str, kv_gb: float = KV_GB) -> float:
    """The card (GiB, up to the next 0.05) on which chapter 06 keeps about
    `kv_gb` of KV cache: (KV + weights + a step's activations) over the
    share of the card the engine uses (common/worker/kv_cache.py)."""
    loaded = load_model("smollm2", dtype, "cpu")
    needed = (kv_gb * GiB + weight_bytes(loaded.model) + activation_bytes_estimate(
        loaded.model.config, MAX_NUM_BATCHED_TOKENS, loaded.dtype))
    return math.ceil(needed / EngineConfig.gpu_memory_utilization / GiB * 20) / 20


def start_servers(dtype: str, card_gb: float, log_dir: Path) -> dict[str, ServerProcess]:
    """Chapter 06's server and the real vLLM, both up (one after the other)."""
    limits = ["--max-num-seqs", str(MAX_NUM_SEQS),
              "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS)]
    ours = ChapterServer("06", free_port(), ["--dtype", dtype, "--device-memory-gb",
                                             str(card_gb), *limits],
                         log_dir / f"ch06-{dtype}.log")
    try:
        theirs = vllm_peer.VllmServer(free_port(), log_dir / f"vllm-{dtype}.log", dtype,
                                      kv_gb=KV_GB, reserved_cpus=0, max_num_seqs=MAX_NUM_SEQS,
                                      max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    except RuntimeError:
        ours.stop()
        raise
    return {OURS: ours, VLLM: theirs}


def kv_cache_tokens(name: str, server: ServerProcess) -> int | None:
    """The KV cache's room in tokens: chapter 06's `/stats`, vLLM's log line."""
    if name == OURS:
        stats = fetch_stats(server.url) or {}
        return stats["num_blocks"] * stats["block_size"] if "num_blocks" in stats else None
    found = re.search(r"KV cache size: ([\d,]+) tokens", server.log_path.read_text())
    return int(found.group(1).replace(",", "")) if found else None


def server_record(name: str, server: ServerProcess, card_gb: float) -> dict:
    """How a server was started, and the KV cache it got."""
    command = (server.shown if name == VLLM else
               " ".join(["python", f"{server.chapter}/server.py", *server.process.args[2:]]))
    return {"command": command, "kv_cache_tokens": kv_cache_tokens(name, server),
            **({"card_gb": card_gb} if name == OURS else {"kv_cache_gb": KV_GB})}


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes of a process group
    (a server and its workers), from /proc/PID/stat."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid:  # pgrp; then utime and stime, fields 14 and 15
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------- the runs
def measure_run(server: ServerProcess, idle: ServerProcess, model: str | None,
                workload: Workload, seed: int, duration_s: float) -> dict:
    """One run on `server` while `idle` waits: its figures, its servers'
    counters over the run, and the CPU the idle one used meanwhile."""
    before, idle_before = counter_totals(server.url, COUNTERS), group_cpu_seconds(idle.process.pid)
    summary = run_workload(server.url, workload, seed, duration_s, model)
    idle_cpu = group_cpu_seconds(idle.process.pid) - idle_before
    after = counter_totals(server.url, COUNTERS)
    grew = {name: after[name] - before[name] for name in COUNTERS}
    queries = grew["vllm:prefix_cache_queries"]
    return {"seed": seed, **{k: summary[k] for k in RUN_FIGURES},
            "prefix_cache_hit_rate": grew["vllm:prefix_cache_hits"] / queries if queries else None,
            "preemptions": int(grew["vllm:num_preemptions"]), "idle_other_cpu_s": idle_cpu}


def warm_up(url: str, model: str | None, workload: Workload, seed: int) -> str:
    """One request of the load, not counted; "" or its error."""
    result, _, _ = chat_turn(url, model, Client(workload, seed, 0).next_messages(),
                             workload.max_tokens)
    return "" if result.ok else result.error


def medians(runs: list[dict]) -> dict:
    """A server's figures over its runs: the median of each (None where no
    run has it), the failures and preemptions summed."""
    out = {}
    for key in ["output_tokens_per_s", *LATENCIES, "prefix_cache_hit_rate"]:
        values = [run[key] for run in runs if run.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    out["failed"] = sum(run["failed"] for run in runs)
    out["preemptions"] = sum(run["preemptions"] for run in runs)
    return out


def ratio_spread(numerators: list[dict], denominators: list[dict]) -> dict:
    """Output tokens/s of one server's runs over the other's, pair by pair:
    the ratios, their median and spread."""
    ratios = [a["output_tokens_per_s"] / b["output_tokens_per_s"]
              for a, b in zip(numerators, denominators) if b["output_tokens_per_s"]]
    return {"ratios": ratios,
            "ratio_median": statistics.median(ratios) if ratios else None,
            "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None)}


def compare(ours: list[dict], theirs: list[dict]) -> dict:
    """Chapter 06 over vLLM, pair by pair (`ratio_spread`); each server's medians."""
    return {**ratio_spread(ours, theirs), OURS: medians(ours), VLLM: medians(theirs)}


def alternated_runs(workload: Workload, servers: dict[str, ServerProcess], seed: int,
                    alternations: int, duration_s: float, label: str = ""
                    ) -> tuple[dict[str, str], dict[str, list[dict]]]:
    """One warm-up request on each of the two servers, then their runs
    alternated, in the dict's order, pair i on seed + i: (the warm-ups'
    errors, each server's runs)."""
    models = {name: served_model(server.url) for name, server in servers.items()}
    errors = {name: warm_up(server.url, models[name], workload, seed + WARMUP_SEED)
              for name, server in servers.items()}
    first, second = servers
    runs: dict[str, list[dict]] = {first: [], second: []}
    for i in range(alternations):
        for name, idle in ((first, second), (second, first)):
            run = measure_run(servers[name], servers[idle], models[name], workload, seed + i,
                              duration_s)
            runs[name].append(run)
            print(f"{workload.name}{label} pair {i + 1}/{alternations} {name}: "
                  f"{run['output_tokens_per_s']:.1f} tok/s, {run['completed']} requests, "
                  f"{run['failed']} failed; idle {idle}: {run['idle_other_cpu_s']:.2f} s CPU",
                  flush=True)
    return errors, runs


def measure_load(workload: Workload, servers: dict[str, ServerProcess], dtype: str,
                 args: argparse.Namespace) -> dict:
    """The warm-ups, then the alternated runs of one load."""
    duration_s = args.duration or workload.duration_s
    errors, runs = alternated_runs(workload, servers, args.seed, args.alternations, duration_s,
                                   f" {dtype}")
    entry = {"load": workload.name, "dtype": dtype, "about": workload.about,
             "duration_s": duration_s, "warm_up_errors": errors, "runs": runs,
             "comparison": compare(runs[OURS], runs[VLLM])}
    completed = [run["completed"] for run in runs[VLLM]]
    entry["vllm_bench_command"] = workload.vllm_bench_command(
        str(vllm_peer.model_dir()), round(statistics.median(completed)) or None, args.seed)
    return entry


def measure_dtype(dtype: str, args: argparse.Namespace, log_dir: Path) -> tuple[dict, list]:
    """Both servers in this dtype, every load on them: (the servers' record, the loads')."""
    card = args.card or card_for_kv(dtype)
    print(f"{dtype}: starting chapter 06 (card {card} GiB) and vLLM ({KV_GB} GiB of KV cache); "
          f"logs in {log_dir}", flush=True)
    servers = start_servers(dtype, card, log_dir)
    try:
        record = {name: server_record(name, server, card) for name, server in servers.items()}
        loads = []
        for name in args.loads:
            try:
                loads.append(measure_load(WORKLOADS[name], servers, dtype, args))
            except requests.RequestException as exc:  # a server that stopped answering
                loads.append({"load": name, "dtype": dtype,
                              "error": f"{type(exc).__name__}: {exc}"})
        return record, loads
    finally:
        for server in servers.values():
            server.stop()


# ------------------------------------------------------------- the report
def per_second(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def fmt(value, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def pair(figures: dict, key: str, scale: float = 1.0, digits: int = 2) -> str:
    """A p50 / p95 pair of one server's medians."""
    p95 = key.replace("p50", "p95")
    return f"{fmt(figures[key], scale, digits)} / {fmt(figures[p95], scale, digits)}"


def throughput_rows(loads: list[dict]) -> list[str]:
    rows = []
    for e in loads:
        if "error" in e:
            rows.append(f"| {e['load']} | {e['dtype']} | error: {e['error']} | | | |")
            continue
        c = e["comparison"]
        ratios = ", ".join(f"{r:.2f}" for r in c["ratios"])
        spread = (f"**{c['ratio_median']:.2f}x** ({c['ratio_min']:.2f}-{c['ratio_max']:.2f})"
                  if c["ratios"] else "-")
        rows.append(f"| {e['load']} | {e['dtype']} | "
                    f"{per_second([r['output_tokens_per_s'] for r in e['runs'][OURS]])} | "
                    f"{per_second([r['output_tokens_per_s'] for r in e['runs'][VLLM]])} | "
                    f"{ratios} | {spread} |")
    return rows


def measured(loads: list[dict]) -> list[dict]:
    """The loads that ran (not those a server stopped answering)."""
    return [e for e in loads if "error" not in e]


def latency_rows(loads: list[dict]) -> list[str]:
    rows = []
    for e in measured(loads):
        for name, label in ((OURS, "ch06"), (VLLM, "vLLM")):
            f = e["comparison"][name]
            hits = f["prefix_cache_hit_rate"]
            rows.append(f"| {e['load']} | {e['dtype']} | {label} | {pair(f, 'ttft_p50_s')} | "
                        f"{pair(f, 'itl_p50_s', 1000, 0)} | {pair(f, 'e2e_p50_s')} | "
                        f"{'-' if hits is None else f'{100 * hits:.1f} %'} | "
                        f"{f['preemptions']} | {f['failed']} |")
    return rows


def idle_lines(loads: list[dict]) -> list[str]:
    """The idle server's CPU during the other's runs, worst run per dtype."""
    lines = []
    for dtype in dict.fromkeys(e["dtype"] for e in measured(loads)):
        for idle, busy in ((VLLM, OURS), (OURS, VLLM)):
            runs = [r for e in measured(loads) if e["dtype"] == dtype for r in e["runs"][busy]]
            worst = max((r["idle_other_cpu_s"] for r in runs), default=0.0)
            lines.append(f"- {dtype}: {idle} idle during {len(runs)} runs of {busy}: at most "
                         f"{worst:.2f} s of CPU in a run (its process group, /proc)")
    return lines


def durations(rec: dict) -> str:
    """Each load's steady state, in words ("30 s (chat-32), 60 s (long)")."""
    if rec["settings"]["duration_s"] is not None or not rec["loads"]:  # one for every load
        return f"{rec['settings']['duration_s']:g} s"
    by_load = {e["load"]: e.get("duration_s") for e in rec["loads"]}
    return ", ".join(f"{d:g} s ({load})" for load, d in by_load.items() if d is not None)


def markdown(rec: dict) -> str:
    m, s = rec["machine"], rec["settings"]
    lines = [f"# Chapter 06 against the real vLLM, runs alternated, {rec['date']}", "",
             f"{m['cpu']}, {m['cores']} cores, {bf16_words(m)}; vLLM {m.get('vllm')}; "
             f"`{rec['command']}`", "",
             f"Each load: one uncounted warm-up request per server, then chapter 06 and vLLM "
             f"alternated, {s['alternations']} pair(s), each run {durations(rec)} of steady "
             f"state (then its answers in flight); both servers up, {s['max_num_seqs']} "
             f"sequences, {s['max_num_batched_tokens']} tokens per step.", ""]
    for dtype, servers in rec["servers"].items():
        ours, theirs = servers[OURS], servers[VLLM]
        lines.append(f"- {dtype}: chapter 06 on a {ours['card_gb']} GiB card, KV cache "
                     f"{ours['kv_cache_tokens']} tokens; vLLM {theirs['kv_cache_gb']} GiB of KV "
                     f"cache, {theirs['kv_cache_tokens']} tokens")
    lines += [f"- {dtype}: skipped, {why}" for dtype, why in rec["skipped"].items()]
    lines += ["", "## Output tokens/s", "",
              "| load | dtype | ch06 runs | vLLM runs | ch06 / vLLM per pair | median (min-max) |",
              "|---|---|---|---|---|---|", *throughput_rows(rec["loads"]),
              "", "## Latency, the median over the runs", "",
              "| load | dtype | server | TTFT p50 / p95 s | ITL p50 / p95 ms | E2E p50 / p95 s | "
              "prefix-cache hits | preemptions | failed |",
              "|---|---|---|---|---|---|---|---|---|", *latency_rows(rec["loads"]),
              "", "## The idle server", "", *idle_lines(rec["loads"]),
              "", "## The loads, and vLLM's own tool", ""]
    done = measured(rec["loads"])
    lines += [f"- `{e['load']}`: {e['about']}. `{e['vllm_bench_command']}`"
              for e in done if e["dtype"] == done[0]["dtype"]]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ main
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=DTYPES)
    p.add_argument("--alternations", type=int, default=3, help="pairs of runs (ch06, vLLM)")
    p.add_argument("--duration", type=float, default=None,
                   help="s of steady state per run (default: each load's own, "
                        "30 s for chat, 60 s for long prompts)")
    p.add_argument("--card", type=float, default=None,
                   help="chapter 06's card, GiB (default: about vLLM's KV cache, per dtype)")
    p.add_argument("--seed", type=int, default=0, help="pair i's requests: seed + i")
    p.add_argument("--label", default="", help="ends the results files' names")
    add_quiet_run_args(p)
    return p


def skipped_dtypes(dtypes: list[str]) -> dict[str, str]:
    """The dtypes this CPU does not compute natively, with why."""
    return {d: "no bf16 in hardware: PyTorch would emulate it" for d in dtypes
            if d == "bfloat16" and not cpu_computes_bfloat16()}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.render:
        render_again(args.render, markdown)
        return 0
    if (problem := vllm_peer.missing()) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    wait_for_quiet_machine(args.wait_quiet, args.quiet_load)
    command = " ".join(["python -m bench.vs_vllm", *(argv if argv is not None else sys.argv[1:])])
    rec = {**record_head(command), "servers": {}, "loads": [],
           "skipped": skipped_dtypes(args.dtypes),
           "settings": {"loads": args.loads, "dtypes": args.dtypes, "seed": args.seed,
                        "alternations": args.alternations, "duration_s": args.duration,
                        "max_num_seqs": MAX_NUM_SEQS,
                        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "vllm_kv_gb": KV_GB}}
    rec["machine"]["vllm"] = vllm_peer.installed_version()
    with tempfile.TemporaryDirectory(prefix="bench-vs-vllm-") as logs:
        for dtype in (d for d in args.dtypes if d not in rec["skipped"]):
            try:
                rec["servers"][dtype], loads = measure_dtype(dtype, args, Path(logs))
            except RuntimeError as exc:  # a server that did not start: its log's tail
                rec["skipped"][dtype] = f"a server did not start: {str(exc).strip()[-300:]}"
                continue
            rec["loads"] += loads
    kind = "vs-vllm" + (f"-{args.label}" if args.label else "")
    write_results(args.out_dir, kind, rec, markdown(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
