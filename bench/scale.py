"""`make bench-scale`: chapter 09 measured, every row in one run on this machine.

Table 1, the engine in the server's process or in its own: one chapter 09
server, `--engine-core in-process` (a thread, as in chapters 03-08) then
`--engine-core process` (vLLM v1's way), the usual chat load
(bench.loadtest, streamed) at 32 and 64 clients: tok/s, TTFT, ITL.

Table 2, more engines: the scale workload (`Workload`, seeded): a few long
system prompts shared by many conversations, each conversation a few
turns that send the whole history again, the conversations all at once.
It is what prefix caching and prefix-aware routing are for. Measured: the
prefix-cache hit rate (tokens found in the cache / tokens asked, from the
servers' `/metrics`, vLLM's counter names, over the run), TTFT p50/p95,
output tok/s. Rows:

- 1 engine with every core (`--data-parallel-size 1`);
- 2 engines with a core each behind one API server (`-dp 2`);
- 2 servers with a core each (`taskset`) behind the chapter's router,
  once per policy: round-robin, least-loaded, prefix-aware (fresh servers
  for each: no policy inherits a warm cache);
- the real vLLM: `--data-parallel-size 2` if its CPU build starts with
  it, else two vLLM servers with a core each behind the router
  (prefix-aware); skipped with the reason where `make vllm` is not done.

Table 3, a replica killed: the same workload behind the prefix-aware
router, and one of its two servers killed (SIGKILL) once every
conversation's first turn is answered. Measured: the turns answered
whole, those that failed, the requests the router sent to the other
replica (retries) and the streams cut mid-way (lost mid-stream).

Results: bench/results/DATE-HOST-scale.{json,md}.

Left out: several machines (the router takes any URL: README), Ray (its
actors run the same servers), a warm-up before each row (every row pays
for its first requests alike).
"""
from __future__ import annotations

import argparse
import os
import random
import re
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import requests

from bench.loadtest import (
    CHAPTERS,
    ROOT,
    RequestResult,
    ServerProcess,
    run_load,
    served_model,
    stream_request,
    summarize,
)
from bench.peers import vllm_peer
from bench.record import bf16_words, record_head, write_results
from common.net import free_port

RESULTS = ROOT / "bench" / "results"
SERVER = [sys.executable, str(ROOT / CHAPTERS["09"] / "server.py")]
WORDS = ("engine cache block token prefix router replica batch schedule memory latency "
         "throughput request stream answer model layer head attention decode prefill").split()
POLICIES = ["round-robin", "least-loaded", "prefix-aware"]


@dataclass
class Workload:
    """Conversations over shared system prompts, seeded: the same in every row."""
    conversations: int = 16
    turns: int = 3
    system_prompts: int = 4
    system_words: int = 220  # ~300 tokens each
    max_tokens: int = 32
    seed: int = 0
    systems: list[str] = field(init=False)
    questions: list[list[str]] = field(init=False)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self.systems = [f"You are assistant number {k}. Facts: " +
                        " ".join(rng.choice(WORDS) for _ in range(self.system_words))
                        for k in range(self.system_prompts)]
        self.questions = [[f"Question {t} of conversation {c}: what is the {rng.choice(WORDS)} "
                           f"of the {rng.choice(WORDS)}?" for t in range(self.turns)]
                          for c in range(self.conversations)]

    def system_of(self, conversation: int) -> str:
        return self.systems[conversation % self.system_prompts]


def chat_turn(url: str, model: str | None, messages: list[dict], max_tokens: int
              ) -> tuple[RequestResult, str, str]:
    """One streamed chat turn: its timings, its answer's text, and which
    replica served it (the router's `x-replica` header; "" without a router)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "model": model}
    try:
        result, text, headers = stream_request(url + "/v1/chat/completions", body, 600)
    except requests.RequestException as exc:
        return RequestResult(False, f"{type(exc).__name__}: {exc}"), "", ""
    return result, text, headers.get("x-replica", "")


def run_workload(url: str, work: Workload) -> dict:
    """Every conversation at once, turn after turn; returns the summary and
    `routes`: which replica served each turn of each conversation."""
    results: list[RequestResult] = []
    routes = [[""] * work.turns for _ in range(work.conversations)]
    lock = threading.Lock()
    model = served_model(url)

    def conversation(c: int) -> None:
        messages = [{"role": "system", "content": work.system_of(c)}]
        for t, question in enumerate(work.questions[c]):
            messages.append({"role": "user", "content": question})
            result, answer, routes[c][t] = chat_turn(url, model, messages, work.max_tokens)
            messages.append({"role": "assistant", "content": answer})
            with lock:
                results.append(result)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=work.conversations) as pool:
        list(pool.map(conversation, range(work.conversations)))
    return {**summarize(results, time.perf_counter() - start), "routes": routes}


def counter_totals(url: str, names: list[str]) -> dict[str, float]:
    """Each Prometheus counter of the server's `/metrics` (vLLM's names, as
    `vllm:num_preemptions`), summed over every engine's samples."""
    text = requests.get(url + "/metrics", timeout=30).text
    total = {}
    for name in names:
        samples = re.findall(rf"^{re.escape(name)}_total(?:{{[^}}]*}})? (\S+)$", text,
                             re.MULTILINE)
        total[name] = sum(float(v) for v in samples)
    return total


def prefix_counters(url: str) -> tuple[float, float]:
    """(hits, queries) in tokens, summed over every engine's samples."""
    total = counter_totals(url, ["vllm:prefix_cache_hits", "vllm:prefix_cache_queries"])
    return total["vllm:prefix_cache_hits"], total["vllm:prefix_cache_queries"]


def measure_workload(front: str, servers: list[str], work: Workload) -> dict:
    before = [prefix_counters(s) for s in servers]
    summary = run_workload(front, work)
    after = [prefix_counters(s) for s in servers]
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    summary["prefix_cache_hit_rate"] = hits / queries if queries else None
    summary["prefix_cache_hit_perc"] = 100 * hits / queries if queries else None
    return summary


# --------------------------------------------------------- servers to run
def chapter_server(name: str, args: list[str], log_dir: Path,
                   cores: str | None = None) -> ServerProcess:
    port = free_port()
    command = [*(["taskset", "-c", cores] if cores else []), *SERVER, "--port", str(port),
               "--dtype", "float32", *args]
    return ServerProcess(name, command, port, log_dir / f"{name}.log")


def router(policy: str, replicas: list[str], log_dir: Path, block_size: int = 16
           ) -> ServerProcess:
    port = free_port()
    command = [sys.executable, "-m", "common.entrypoints.router", "--port", str(port),
               "--policy", policy, "--block-size", str(block_size),
               *[w for url in replicas for w in ("--replica", url)]]
    return ServerProcess(f"router-{policy}", command, port, log_dir / f"router-{policy}.log")


def stop_all(processes: list[ServerProcess]) -> None:
    for process in processes:
        process.stop()


def start_pair(start) -> list[ServerProcess]:
    """Two servers started side by side (each loads the model meanwhile);
    if one fails to start, the other is stopped before the error goes on."""
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start, i) for i in range(2)]
    started = [f.result() for f in futures if f.exception() is None]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        stop_all(started)
        raise failed[0]
    return started


# ------------------------------------------------------------- the rows
def engine_rows(args, log_dir: Path) -> list[dict]:
    rows = []
    for mode in ("in-process", "process"):
        server = chapter_server(f"engine-{mode}", ["--engine-core", mode, *args.server_args],
                                log_dir)
        try:
            for clients in args.clients:
                summary = run_load(server.url, clients, 1, args.max_tokens, stream=True)
                rows.append({"engine_core": mode, "clients": clients, **summary})
        finally:
            server.stop()
    return rows


def workload_rows(args, work: Workload, log_dir: Path) -> list[dict]:
    rows = []
    for dp in (1, 2):
        name = f"1 engine x {args.cores} cores" if dp == 1 else "2 engines x 1 core, 1 server"
        server = chapter_server(f"dp{dp}", ["-dp", str(dp), *args.server_args], log_dir)
        try:
            rows.append({"row": name, **measure_workload(server.url, [server.url], work)})
        finally:
            server.stop()
    for policy in POLICIES:
        replicas = start_pair(lambda i: chapter_server(f"{policy}-{i}", args.server_args,
                                                       log_dir, cores=str(i)))
        try:
            front = router(policy, [r.url for r in replicas], log_dir)
            try:
                rows.append({"row": f"2 servers x 1 core, router: {policy}",
                             **measure_workload(front.url, [r.url for r in replicas], work)})
            finally:
                front.stop()
        finally:
            stop_all(replicas)
    return rows + ([] if args.skip_vllm else vllm_rows(work, log_dir))


def vllm_rows(work: Workload, log_dir: Path) -> list[dict]:
    problem = vllm_peer.missing()
    if problem:
        return [{"row": "the real vLLM", "skipped": problem}]
    try:
        server = vllm_peer.VllmServer(free_port(), log_dir / "vllm-dp2.log",
                                      extra=["--data-parallel-size", "2"])
    except RuntimeError as exc:
        reason = str(exc).strip().splitlines()[-1][:200]
    else:
        try:
            return [{"row": "the real vLLM, --data-parallel-size 2",
                     **measure_workload(server.url, [server.url], work)}]
        finally:
            server.stop()
    replicas = start_pair(lambda i: vllm_peer.VllmServer(
        free_port(), log_dir / f"vllm-{i}.log", omp_threads_bind=str(i)))
    try:
        front = router("prefix-aware", [r.url for r in replicas], log_dir)
        try:
            return [{"row": "the real vLLM, 2 servers x 1 core, router: prefix-aware",
                     "note": f"--data-parallel-size 2 did not start: {reason}",
                     **measure_workload(front.url, [r.url for r in replicas], work)}]
        finally:
            front.stop()
    finally:
        stop_all(replicas)


def failover_row(args, work: Workload, log_dir: Path) -> dict:
    """Table 3: the workload behind the prefix-aware router; replica 1 is
    killed once the router has served every conversation's first turn."""
    replicas = start_pair(lambda i: chapter_server(f"failover-{i}", args.server_args, log_dir,
                                                   cores=str(i)))
    try:
        front = router("prefix-aware", [r.url for r in replicas], log_dir)
        try:
            summary: dict = {}
            load = threading.Thread(
                target=lambda: summary.update(run_workload(front.url, work)))
            load.start()
            served = 0
            while load.is_alive() and served < work.conversations:
                served = sum(requests.get(front.url + "/router/stats", timeout=30)
                             .json()["served"].values())
                time.sleep(0.05)
            replicas[1].process.kill()
            load.join()
            stats = requests.get(front.url + "/router/stats", timeout=30).json()
            return {"row": "2 servers x 1 core, router: prefix-aware, replica 1 killed",
                    "killed_after_served": served, "retries": stats["retries"],
                    "lost_mid_stream": stats["lost_mid_stream"], **summary}
        finally:
            front.stop()
    finally:
        stop_all(replicas)


# ------------------------------------------------------------- reporting
def draw_routes(record: dict, path: Path) -> None:
    """Which replica served each turn of each conversation, one panel per
    router policy, the conversations grouped by system prompt."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    rows = [r for r in record["scale_out"] if r.get("routes") and any(map(any, r["routes"]))]
    if not rows:
        return
    systems = record["workload"]["system_prompts"]
    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 4.2), squeeze=False)
    for ax, row in zip(axes[0], rows):
        order = sorted(range(len(row["routes"])), key=lambda c: (c % systems, c))
        grid = [[int(name.rsplit("-", 1)[1]) if name else -1 for name in row["routes"][c]]
                for c in order]
        ax.imshow(grid, cmap=ListedColormap(["#d9d9d9", "#4c72b0", "#dd8452"]),
                  vmin=-1, vmax=1, aspect="auto")
        ax.set_title(f"{row['row'].split(': ')[-1]}\nhit rate {row['prefix_cache_hit_perc']:.1f} %",
                     fontsize=9)
        ax.set_xticks(range(len(grid[0])), [f"turn {t + 1}" for t in range(len(grid[0]))],
                      fontsize=7)
        ax.set_yticks(range(len(order)), [f"conv {c} (system {c % systems})" for c in order],
                      fontsize=6)
    fig.suptitle("Which replica served each turn (blue: replica-0, orange: replica-1)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")



def ms(value) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def table_head(title: str, columns: list[str]) -> list[str]:
    """A section's heading and its table's header rows."""
    return ["", f"## {title}", "", "| " + " | ".join(columns) + " |",
            "|" + "---|" * len(columns)]


def markdown(record: dict) -> str:
    """The run's tables (a table a run skipped is left out)."""
    m = record["machine"]
    lines = [f"# make bench-scale, {record['date']}", "",
             f"{m['cpu']}, {m['cores']} cores, {bf16_words(m)}; `{record['command']}`"]
    if record["engine_core"]:
        lines += table_head("The engine in the server's process or in its own",
                            ["engine core", "clients", "tok/s", "TTFT p50 ms", "TTFT p95 ms",
                             "ITL p50 ms", "failed"])
    for r in record["engine_core"]:
        lines.append(f"| {r['engine_core']} | {r['clients']} | {r['output_tokens_per_s']:.1f} | "
                     f"{ms(r['ttft_p50_s'])} | {ms(r['ttft_p95_s'])} | {ms(r['itl_p50_s'])} | "
                     f"{r['failed']} |")
    work = record["workload"]
    if record["scale_out"]:
        lines += table_head(f"More engines: {work['conversations']} conversations x "
                            f"{work['turns']} turns over {work['system_prompts']} shared "
                            "system prompts",
                            ["row", "prefix-cache hit rate", "TTFT p50 ms", "TTFT p95 ms",
                             "tok/s", "failed"])
    for r in record["scale_out"]:
        if "skipped" in r:
            lines.append(f"| {r['row']} | skipped: {r['skipped']} | | | | |")
            continue
        rate = r["prefix_cache_hit_perc"]
        lines.append(f"| {r['row']} | {'-' if rate is None else f'{rate:.1f} %'} | "
                     f"{ms(r['ttft_p50_s'])} | {ms(r['ttft_p95_s'])} | "
                     f"{r['output_tokens_per_s']:.1f} | {r['failed']} |")
    lines += [f"\n{r['row']}: {r['note']}" for r in record["scale_out"] if r.get("note")]
    if record.get("failover"):
        lines += table_head("A replica killed under the same workload",
                            ["row", "killed after", "turns", "answered whole", "failed",
                             "retried elsewhere", "cut mid-stream", "tok/s"])
        for r in record["failover"]:
            lines.append(f"| {r['row']} | {r['killed_after_served']} served | "
                         f"{r['completed'] + r['failed']} | {r['completed']} | {r['failed']} | "
                         f"{r['retries']} | {r['lost_mid_stream']} | "
                         f"{r['output_tokens_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[32, 64])
    p.add_argument("--max-tokens", type=int, default=64, help="table 1's answers")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--skip-engine-core", action="store_true", help="table 2 only")
    p.add_argument("--skip-scale-out", action="store_true", help="table 1 only")
    p.add_argument("--skip-vllm", action="store_true", help="no real vLLM row")
    p.add_argument("--skip-failover", action="store_true", help="no table 3")
    p.add_argument("--out", type=Path, default=RESULTS)
    args, args.server_args = p.parse_known_args(argv)
    args.cores = len(os.sched_getaffinity(0))
    work = Workload(conversations=args.conversations, turns=args.turns)
    record = {**record_head(" ".join(["python -m bench.scale", *(argv or sys.argv[1:])])),
              "workload": {k: getattr(work, k) for k in
                           ("conversations", "turns", "system_prompts", "max_tokens", "seed")}}
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as logs:
        record["engine_core"] = [] if args.skip_engine_core else engine_rows(args, Path(logs))
        record["scale_out"] = [] if args.skip_scale_out else workload_rows(args, work, Path(logs))
        record["failover"] = [] if args.skip_failover else [failover_row(args, work, Path(logs))]
    if not (args.skip_vllm or args.skip_scale_out):
        record["machine"]["vllm"] = vllm_peer.installed_version()
    stem = write_results(args.out, "scale", record, markdown(record))
    draw_routes(record, stem.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
