"""`make bench`: every chapter on the same card and the same load (bench).

    python -m bench.bench                  # chapters 01-06, demo card (~10 min, 2-core CPU)
    python -m bench.bench --preset quick   # the same in about 2 minutes
    python -m bench.bench --peers          # + the real vLLM, llama.cpp, transformers' ways
    python -m bench.bench --peers vllm --chapters 02 05 06   # the course next to vLLM
    python -m bench.bench --url http://host:8000   # + any running OpenAI-compatible server
    python -m bench.bench --preset sweep   # tokens/s and p95 latency vs clients
    python -m bench.bench --preset gpu     # CUDA, dummy Llama-1B in bfloat16

This module is the command line: it reads the flags into a preset's
settings, runs the bench and writes what it measured. The jobs it calls:

- bench/presets.py: the settings, the presets, and the plan of a run (one
  entry per system: the chapters, chapter 02 twice, chapter 01 with a
  lighter load, the levers, the running servers, the peers);
- bench/measure.py: each entry measured, one row per system and load (a
  chapter's server started on its card, the load test run on it, its
  `/stats` read; a server that is not ours probed first), then the ratios
  `x ch02` and `x vLLM`;
- bench/table.py and bench/plot.py: the markdown table and the figure;
- bench/record.py: the machine the run was measured on.

The same load runs over HTTP against servers that are not ours: any running
OpenAI-compatible server (`--url`, one row each), and, with `--peers`, the
real vLLM (`vllm`: `make vllm` installs it, bench/peers/vllm_peer.py starts it on
the embedded model, once in float32 and once in bfloat16, with the
chapters' `--max-num-seqs` and `--max-num-batched-tokens`) and llama.cpp's
`llama-server` (bench/peers/llamacpp.py). A peer that is not installed or built
gives a row that says how to get it. With the vLLM peer and chapter 06,
chapter 06 also runs in bfloat16 (the `bfloat16` lever), so that each
vLLM row has a chapter 06 row of its dtype: the `x vLLM` column divides
every row's output tokens/s by the vLLM row of the same dtype and load.

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
`--redraw` with a run's JSON measures nothing: it computes the ratios again
and writes the table and the figure.

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
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.loadtest import CHAPTERS, ROOT
from bench.measure import add_ladder_ratios, add_ratios, add_vllm_ratios, run_bench
from bench.peers import llamacpp, vllm_peer
from bench.plot import draw
from bench.presets import (
    ALL_PEERS,
    LEVER_FLAGS,
    PRESETS,
    VLLM,
    Settings,
    figure_name,
    plan,
    result_stem,
)
from bench.record import machine
from bench.table import render_markdown

BENCH_DIR = ROOT / "bench"


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The preset's settings, with what the flags change."""
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
    """The bench's flags: an absent one keeps the preset's value."""
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


def record(s: Settings, rows: list[dict], when: datetime.datetime, duration: float,
           command: str) -> dict:
    """A run's record, its JSON: when, the command, the machine, the settings, the rows."""
    return {"date": when.isoformat(timespec="seconds"), "command": command,
            "figure": figure_name(s),
            "duration_s": duration, "machine": machine(with_vllm=VLLM in s.peers),
            "settings": dataclasses.asdict(s), "rows": rows}


def write_table_and_figure(rec: dict, json_path: Path, figure: Path) -> None:
    """The record's markdown table (beside its JSON) and its figure."""
    table = render_markdown(rec)
    json_path.with_suffix(".md").write_text(table)
    draw(rec, figure)
    print("\n" + table)
    print(f"wrote {json_path}, its .md table and {figure}")


def redraw(json_path: Path, out_dir: Path) -> None:
    """--redraw: a results file's ratios computed again (derived, not measured:
    as this version computes them), then its table and figure written again."""
    rec = json.loads(json_path.read_text())
    figure = rec.get("figure") or rec["settings"]["figure"]  # older files: the preset's
    add_ratios(rec["rows"])
    add_ladder_ratios(rec["rows"])
    add_vllm_ratios(rec["rows"])
    json_path.write_text(json.dumps(rec, indent=2) + "\n")
    write_table_and_figure(rec, json_path, out_dir / figure)


def refusal(s: Settings) -> str | None:
    """Why these settings cannot run here (None: they can)."""
    if not s.chapters and not s.urls and not s.peers and not s.levers:
        return "error: nothing to measure: no chapters, no --levers, no --url, no --peers"
    unknown = [c for c in s.chapters if c not in CHAPTERS]
    if unknown:
        return f"error: no chapter {', '.join(unknown)}; chapters are {', '.join(CHAPTERS)}"
    if s.require_cuda and not torch.cuda.is_available():
        return (f"error: preset {s.preset!r} needs a CUDA GPU, and torch {torch.__version__} "
                "sees none here. On the CPU run `make bench`.")
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.redraw:
        redraw(args.redraw, args.out_dir)
        return 0
    s = settings_from_args(args)
    if (why := refusal(s)) is not None:
        print(why, file=sys.stderr)
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
    json_path = results / f"{result_stem(s, when, rec['machine']['host'])}.json"
    json_path.write_text(json.dumps(rec, indent=2) + "\n")
    write_table_and_figure(rec, json_path, args.out_dir / figure_name(s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
