"""Measuring the plan's entries: one row per system and load (`make bench`).

`run_bench` measures each entry of the plan (bench/presets.py) and gives
one row per entry and number of clients, every row with every one of
`FIGURES` (None where a system has no such figure):

- a chapter (`measure_chapter`): its server started on its card
  (`bench.loadtest.ChapterServer`), one uncounted warm-up request, the
  load test once per number of clients (`bench.loadtest.run_load`), the
  server's `/stats` read, the server stopped. A load cut short by the
  deadline leaves the next load a fresh server. A chapter whose
  `server.py` is not written yet, or whose server does not start, gives
  rows that say so, not a crash;
- a server that is not ours (`measure_http`: a `--url`, the real vLLM,
  llama.cpp's server): a first, uncounted request probes it (`probe`): a
  server that refuses `ignore_eos` (a vLLM extra) or streaming is loaded
  without it and its row says so. The tokens counted are always those
  its `usage` reports, and a row whose answers came out shorter than
  `max_tokens` says that too;
- transformers' own ways (`measure_peers`): in this process, on one copy
  of the model.

Then the ratios: `x_ch02` (output tokens/s over chapter 02's on the roomy
card, same clients) and `x_vllm` (over the real vLLM's of the same dtype).

Left out: repeated runs and error bars (one run per row), and the table
and figure (bench/table.py, bench/plot.py).
"""
from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from bench.loadtest import (
    CHAPTERS,
    ROOT,
    ChapterServer,
    fetch_stats,
    run_load,
    send_one,
    served_model,
)
from bench.peers import llamacpp, vllm_peer
from bench.peers.hf_peers import PEERS, run_peer
from bench.presets import LLAMACPP, VLLM, Entry, Settings, plan
from common.loader import EMBEDDED_NAMES, load_model
from common.net import free_port

# Every row carries every one of these (None where a system has no such figure).
FIGURES = ["completed", "failed", "first_error", "duration_s", "output_tokens",
           "output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p95_s",
           "tpot_mean_s", "itl_p50_s", "e2e_p50_s", "e2e_p95_s",
           "peak_kv_reserved_bytes", "peak_kv_used_bytes", "kv_waste_perc",
           "peak_running", "preemptions", "kv_room_tokens", "requests_that_fit",
           "prefix_cache_hit_rate",
           "x_ch02", "x_vllm", "x_above"]


# ---------------------------------------------------------------- rows
def empty_row(entry: Entry, clients: int, status: str, error: str | None = None) -> dict:
    """A row with every figure absent: what a skipped or failed entry leaves."""
    system = CHAPTERS.get(entry.chapter) or entry.peer or "url"
    row = {"name": entry.name, "system": system, "url": entry.url, "dtype": entry.dtype,
           "card_gb": entry.card_gb, "clients": clients, "requests_per_client": entry.requests,
           "max_tokens": entry.max_tokens, "stream": entry.stream,
           "status": status, "note": entry.note, "change": entry.change, "moves": entry.moves}
    row.update(dict.fromkeys(FIGURES))
    row["first_error"] = error
    return row


def requests_that_fit(stats: dict, before: dict, completed: int, max_tokens: int) -> int | None:
    """How many of this load's requests the KV cache holds at once: its
    blocks over the blocks one request takes (its mean prompt, by /stats,
    plus its output). Chapter 03's block is a whole region: one each."""
    if not completed:
        return None
    prompt = (stats["prompt_tokens"] - before.get("prompt_tokens", 0)) / completed
    per_request = math.ceil((prompt + max_tokens) / stats["block_size"])
    return stats["num_blocks"] // per_request


def row_from_summary(entry: Entry, clients: int, summary: dict,
                     stats_before: dict | None) -> dict:
    """The load test's summary (+ the server's /stats) -> one row."""
    row = empty_row(entry, clients, "ok" if summary["failed"] == 0 else "failures")
    row.update({k: summary[k] for k in FIGURES if k in summary})
    row["first_error"] = summary["first_errors"][0] if summary["first_errors"] else None
    stats = summary.get("server_stats") or {}
    if "avg_kv_waste_perc" in stats:
        before = (stats_before or {}).get("num_preemptions", 0)
        row.update(peak_kv_reserved_bytes=stats["peak_kv_reserved_bytes"],
                   peak_kv_used_bytes=stats["peak_kv_used_bytes"],
                   kv_waste_perc=stats["avg_kv_waste_perc"],
                   peak_running=stats["peak_running"],
                   preemptions=stats["num_preemptions"] - before,
                   kv_room_tokens=stats["num_blocks"] * stats["block_size"],
                   requests_that_fit=requests_that_fit(stats, stats_before or {},
                                                       summary["completed"], entry.max_tokens),
                   prefix_cache_hit_rate=stats["prefix_cache_hit_rate"])
    expected = (row["completed"] or 0) * entry.max_tokens
    if row["output_tokens"] is not None and row["output_tokens"] < expected:
        row["note"] = "; ".join(filter(None, [row["note"], (
            f"answers shorter than asked: {row['output_tokens']} of {expected} tokens "
            "(usage), EOS not ignored")]))
    return row


def add_ratios(rows: list[dict]) -> None:
    """x_ch02: output tokens/s over chapter 02's at the same number of clients
    (on the roomy card where there is one, since it fails on the demo card).
    A chapter 02 row with failures is no baseline: then there is no ratio."""
    for row in rows:
        row["x_ch02"] = None
        refs = [r for r in rows if r["system"] == CHAPTERS["02"] and r["clients"] == row["clients"]
                and r["output_tokens_per_s"] and r["completed"] and not r["failed"]]
        refs.sort(key=lambda r: r["name"] != "02 (roomy)")
        if refs and row["output_tokens_per_s"] is not None:
            row["x_ch02"] = row["output_tokens_per_s"] / refs[0]["output_tokens_per_s"]


def add_ladder_ratios(rows: list[dict]) -> None:
    """x_above: a ladder row's output tokens/s over the row above's, at the
    same number of clients (the one change it makes, priced)."""
    ladder = [row for row in rows if row.get("change")]
    for row in rows:
        row["x_above"] = None
    for clients in {row["clients"] for row in ladder}:
        mine = [row for row in ladder if row["clients"] == clients]
        for above, row in zip(mine, mine[1:]):
            if above["output_tokens_per_s"] and row["output_tokens_per_s"] is not None:
                row["x_above"] = row["output_tokens_per_s"] / above["output_tokens_per_s"]


def add_vllm_ratios(rows: list[dict]) -> None:
    """x_vllm: output tokens/s over the real vLLM's, same dtype, same clients
    (the course's honest score: chapter 06 against vLLM)."""
    for row in rows:
        row["x_vllm"] = None
        refs = [r for r in rows if r["system"] == VLLM and r["dtype"] == row["dtype"]
                and r["clients"] == row["clients"] and r["output_tokens_per_s"]]
        if refs and row["output_tokens_per_s"] is not None and row["dtype"]:
            row["x_vllm"] = row["output_tokens_per_s"] / refs[0]["output_tokens_per_s"]


# ------------------------------------------------------------ a chapter
def server_args(s: Settings, card_gb: float | None) -> list[str]:
    args = [s.model, "--load-format", s.load_format, "--dtype", s.dtype,
            "--max-num-seqs", str(s.max_num_seqs),
            "--max-num-batched-tokens", str(s.max_num_batched_tokens)]
    return args + (["--device-memory-gb", str(card_gb)] if card_gb is not None else [])


def progress_bar(entry: Entry, clients: int) -> tqdm:
    card = "" if entry.chapter is None else f" @ {entry.card_gb or 'whole'} GiB"
    return tqdm(total=clients * entry.requests, unit="req", file=sys.stderr,
                desc=f"{entry.name}{card}, {clients} clients", dynamic_ncols=True)


def last_line(exc: Exception) -> str:
    """What a server that failed to start said last (its log's tail ends the error)."""
    text = str(exc).strip()
    return text.splitlines()[-1] if text else repr(exc)


def start_server(entry: Entry, s: Settings, log_dir: Path) -> tuple[ChapterServer | None, str]:
    """(the running server, "") or (None, why it did not start)."""
    log_path = log_dir / (re.sub(r"\W+", "-", f"ch{entry.name}").strip("-") + ".log")
    try:
        server = ChapterServer(entry.chapter, free_port(),
                               server_args(s, entry.card_gb) + entry.server_flags, log_path)
        # One short request first, not counted (vLLM's benchmark does the same):
        # the first call pays for lazy initialisations.
        send_one(server.url, 0, 2, False, s.deadline_s, None)
        return server, ""
    except RuntimeError as exc:
        return None, f"server failed to start: {last_line(exc)}"


def measure_load(url: str, entry: Entry, clients: int, s: Settings, model: str | None = None,
                 ignore_eos: bool = True) -> dict:
    before = fetch_stats(url)
    with progress_bar(entry, clients) as bar:
        summary = run_load(url, clients, entry.requests, entry.max_tokens, stream=entry.stream,
                           timeout=s.deadline_s, deadline=s.deadline_s, model=model,
                           progress=bar, ignore_eos=ignore_eos)
    return row_from_summary(entry, clients, summary, before)


def measure_chapter(entry: Entry, s: Settings, log_dir: Path) -> list[dict]:
    """Start the chapter's server, run each load on it, stop it. A load cut
    short by the deadline may leave the server busy: the next load gets a
    fresh server. A server that does not start gives rows of errors."""
    folder = CHAPTERS[entry.chapter]
    if not (ROOT / folder / "server.py").exists():
        return [empty_row(entry, c, "skipped", f"{folder}/server.py is not written yet")
                for c in entry.clients]
    rows, server, error = [], None, ""
    try:
        for clients in entry.clients:
            if server is None and not error:
                server, error = start_server(entry, s, log_dir)
            if server is None:
                rows.append(empty_row(entry, clients, "error", error))
                continue
            rows.append(measure_load(server.url, entry, clients, s))
            if rows[-1]["duration_s"] >= s.deadline_s:
                server.stop()
                server = None
    finally:
        if server is not None:
            server.stop()
    return rows


# ------------------------------------------------- servers that are not ours
@dataclass
class Probe:
    """How a server that is not ours takes the load (from the first request)."""
    model: str | None
    ignore_eos: bool = True
    stream: bool = True
    error: str = ""  # the warm-up failed for another reason: the rows are errors
    changes: list[str] = field(default_factory=list)


def probe(url: str, stream: bool, timeout: float) -> Probe:
    """One short request, not counted, as for the chapters. A 400 that names
    `ignore_eos` (OpenAI's "Unrecognized request argument", ...) drops it; one
    that names `stream`, or an answer that does not stream, drops streaming."""
    found = Probe(served_model(url), stream=stream)
    for _ in range(3):
        result = send_one(url, 0, 2, found.stream, timeout, found.model, found.ignore_eos)
        error = result.error
        if result.ok:
            return found
        if found.ignore_eos and error.startswith("HTTP 400") and "ignore_eos" in error:
            found.ignore_eos = False
            found.changes.append("refused ignore_eos, loaded without it")
        elif found.stream and ("stream" in error or "without streaming" in error):
            found.stream = False
            found.changes.append("does not stream here: whole answers")
        else:
            break
    found.error = f"the first request failed: {error}"
    return found


def measure_http(entry: Entry, url: str, s: Settings, clients: list[int]) -> list[dict]:
    """The load on a server that is not ours and is already running."""
    found = probe(url, entry.stream, s.deadline_s)
    if found.model and not entry.named:
        entry.name = found.model
    if found.error:
        return [empty_row(entry, c, "error", found.error) for c in clients]
    entry.stream = found.stream
    entry.note = "; ".join(filter(None, [entry.note, *found.changes]))
    return [measure_load(url, entry, c, s, found.model, found.ignore_eos) for c in clients]


def measure_llamacpp(entry: Entry, s: Settings, log_dir: Path) -> list[dict]:
    """llama.cpp's llama-server on the embedded model, started once per load
    (one slot per client: -np N), stopped after it."""
    dtype = s.llamacpp_dtype
    if s.model not in EMBEDDED_NAMES:
        return [empty_row(entry, c, "skipped", f"llama.cpp runs the embedded model only "
                          f"(this bench: {s.model})") for c in entry.clients]
    problem = llamacpp.missing(dtype)
    if problem:
        return [empty_row(entry, c, "skipped", problem) for c in entry.clients]
    rows = []
    for clients in entry.clients:
        log_path = log_dir / f"llama-server-{dtype}-{clients}.log"
        try:
            server = llamacpp.LlamaServer(dtype, free_port(), clients, entry.max_tokens,
                                          log_path,
                                          threads=s.llamacpp_threads or torch.get_num_threads())
        except RuntimeError as exc:
            rows.append(empty_row(entry, clients, "error",
                                  f"llama-server failed to start: {last_line(exc)}"))
            continue
        with server:
            entry.note = server.note
            rows += measure_http(entry, server.url, s, [clients])
    return rows


def measure_vllm(entry: Entry, s: Settings, log_dir: Path) -> list[dict]:
    """The real vLLM on the embedded model in the entry's dtype, started once
    for all the loads, with the chapters' scheduling limits."""
    if s.model not in EMBEDDED_NAMES:
        return [empty_row(entry, c, "skipped", f"the vLLM row runs the embedded model only "
                          f"(this bench: {s.model})") for c in entry.clients]
    problem = vllm_peer.missing()
    if problem:
        return [empty_row(entry, c, "skipped", problem) for c in entry.clients]
    try:
        server = vllm_peer.VllmServer(free_port(), log_dir / f"vllm-{entry.dtype}.log",
                                      entry.dtype, kv_gb=s.vllm_kv_gb,
                                      reserved_cpus=s.vllm_reserved_cpus,
                                      max_num_seqs=s.max_num_seqs,
                                      max_num_batched_tokens=s.max_num_batched_tokens)
    except RuntimeError as exc:
        return [empty_row(entry, c, "error", f"vLLM failed to start: {last_line(exc)}")
                for c in entry.clients]
    with server:
        cores = ("every core computes" if s.vllm_reserved_cpus == 0 else
                 f"{s.vllm_reserved_cpus} core(s) kept for its front end, vLLM's default")
        entry.note = (f"the real vLLM, {s.vllm_kv_gb} GiB of KV cache, {cores} "
                      f"(VLLM_CPU_NUM_OF_RESERVED_CPU={s.vllm_reserved_cpus})")
        return measure_http(entry, server.url, s, entry.clients)


# ---------------------------------------------------- transformers' ways
def measure_peers(entries: list[Entry], s: Settings) -> list[dict]:
    """The peers, in this process, on one copy of the model loaded once."""
    loaded = load_model(s.model, s.dtype, "auto", s.load_format)
    run_peer("hf-generate", loaded, 1, 1, 2)  # the warm-up request, not counted
    rows = []
    for entry in entries:
        for clients in entry.clients:
            with progress_bar(entry, clients) as bar:
                summary = run_peer(entry.peer, loaded, clients, entry.requests,
                                   entry.max_tokens, s.deadline_s, bar,
                                   max_batch_tokens=s.max_num_batched_tokens)
            rows.append(row_from_summary(entry, clients, summary, None))
    del loaded
    return rows


# ------------------------------------------------------------- the run
def run_bench(s: Settings, log_dir: Path) -> list[dict]:
    """Every entry of the plan, in order (transformers' peers last, on one
    model loaded once), then the ratios."""
    entries = plan(s)
    rows = []
    for entry in entries:
        if entry.chapter is not None:
            rows += measure_chapter(entry, s, log_dir)
        elif entry.url is not None:
            rows += measure_http(entry, entry.url, s, entry.clients)
        elif entry.peer == LLAMACPP:
            rows += measure_llamacpp(entry, s, log_dir)
        elif entry.peer == VLLM:
            rows += measure_vllm(entry, s, log_dir)
    peers = [e for e in entries if e.peer in PEERS]
    if peers:
        rows += measure_peers(peers, s)
    add_ratios(rows)
    add_ladder_ratios(rows)
    add_vllm_ratios(rows)
    return rows
