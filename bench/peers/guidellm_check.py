"""GuideLLM beside our load test, on the same server and the same load (bench).

    make guidellm CH=05 CLIENTS=8 REQUESTS=2 MAX_TOKENS=32
    make guidellm URL=http://127.0.0.1:8080 CLIENTS=8 REQUESTS=2 MAX_TOKENS=32
    python -m bench.peers.guidellm_check --chapter 05 --clients 8 --requests 2 --max-tokens 32

GuideLLM (PyPI `guidellm`) is the benchmark tool vLLM's documentation
recommends. It lives in its own venv (`.guidellm-venv/`, which `make guidellm`
installs on first use) so that `make setup` stays lean, and it is run here
as an independent check of `bench/loadtest.py`'s figures:

1. start the chapter's server (`--chapter`, float32, as `make serve`) or
   take a running one (`--url`);
2. GuideLLM: `clients` concurrent streams (`--profile kind=concurrent`),
   `clients x requests` requests in all (`--constraint kind=max_requests`),
   synthetic prompts of `--prompt-tokens` tokens and answers of exactly
   `max_tokens` (it sends `ignore_eos`), counted with the embedded model's
   tokenizer from its local folder (offline), streamed only where the
   server streams (chapter 06, or `--url` unless `--no-stream`);
3. our load test: the same clients, requests and tokens on the same server;
4. both summaries side by side, and GuideLLM's JSON in `--out`.

The prompts differ: GuideLLM's are random text in one user message (the
chat template then adds the model's default system prompt, about 30
tokens), ours the 16 fixed questions under one system prompt (35 tokens on
average with the template). The default `--prompt-tokens 8` makes the two
about the same length.

Left out: GuideLLM's sweeps and rate-based profiles (one concurrency
only), and its multimodal and multi-turn data.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.loadtest import ROOT, ChapterServer, format_table, run_load, served_model
from common.net import free_port

STREAMING_CHAPTERS = {"06", "07", "08"}
GUIDELLM = ROOT / ".guidellm-venv" / "bin" / "guidellm"


def guidellm_command(guidellm: Path, url: str, model: str | None, tokenizer: Path,
                     clients: int, total: int, max_tokens: int, prompt_tokens: int,
                     stream: bool, max_seconds: float, out: Path) -> list[str]:
    backend = f"kind=openai_http,target={url},stream={str(stream).lower()}"
    if model:
        backend += f",model={model}"
    return [str(guidellm), "run", "--backend", backend,
            "--profile", f"kind=concurrent,streams={clients}",
            "--constraint", f"kind=max_requests,count={total}",
            "--constraint", f"kind=max_duration,seconds={max_seconds:g}",
            "--data", (f"kind=synthetic_text,prompt_tokens={prompt_tokens},"
                       f"output_tokens={max_tokens}"),
            "--tokenizer", f"kind=hf_auto,model={tokenizer}",
            "--output", f"kind=json,path={out}", "--output", "kind=console",
            "--disable-console-interactive"]


def _get(tree, *path, default=None):
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return default
        tree = tree[key]
    return tree


def guidellm_summary(report: dict, stream: bool) -> dict:
    """The figures of GuideLLM's (first) benchmark that our load test also
    reports, read from its JSON, in our units (s, tokens/s). Without
    streaming its TTFT and TPOT say nothing (0, or latency / tokens): None."""
    bench = (report.get("benchmarks") or [{}])[0]
    metrics = bench.get("metrics", {})
    totals = _get(metrics, "request_totals") or _get(bench, "request_totals") or {}

    def stat(name: str, field: str, scale: float = 1.0):
        value = _get(metrics, name, "successful", field)
        return None if value is None else value * scale

    return {
        "completed": totals.get("successful"), "failed": totals.get("errored"),
        "incomplete": totals.get("incomplete"),
        "duration_s": _get(bench, "duration"),
        "output_tokens_per_s": stat("output_tokens_per_second", "mean"),
        "requests_per_s": stat("requests_per_second", "mean"),
        "output_tokens": stat("output_token_count", "total_sum"),
        "e2e_p50_s": stat("request_latency", "median"),
        "e2e_p95_s": _get(metrics, "request_latency", "successful", "percentiles", "p95"),
        "ttft_p50_s": stat("time_to_first_token_ms", "median", 1e-3) if stream else None,
        "tpot_mean_s": stat("time_per_output_token_ms", "mean", 1e-3) if stream else None,
    }


def side_by_side(ours: dict, theirs: dict) -> str:
    rows = [("completed / failed", "completed", "failed", "{}"),
            ("duration s", "duration_s", None, "{:.1f}"),
            ("output tokens", "output_tokens", None, "{:.0f}"),
            ("output tokens/s", "output_tokens_per_s", None, "{:.1f}"),
            ("requests/s", "requests_per_s", None, "{:.2f}"),
            ("e2e p50 s", "e2e_p50_s", None, "{:.2f}"),
            ("e2e p95 s", "e2e_p95_s", None, "{:.2f}"),
            ("TTFT p50 s", "ttft_p50_s", None, "{:.2f}"),
            ("TPOT mean ms", "tpot_mean_s", None, "{:.0f}")]

    def cell(summary: dict, key: str, second: str | None, fmt: str) -> str:
        value = summary.get(key)
        if value is None:
            return "-"
        scale = 1000 if key == "tpot_mean_s" else 1
        text = fmt.format(value * scale)
        return f"{text} / {summary.get(second)}" if second else text

    lines = ["| figure | our load test | GuideLLM |", "|---|---|---|"]
    lines += [f"| {name} | {cell(ours, key, second, fmt)} | {cell(theirs, key, second, fmt)} |"
              for name, key, second, fmt in rows]
    return "\n".join(lines)


def run(url: str, args: argparse.Namespace, stream: bool) -> int:
    from common.loader import convert_embedded_model
    tokenizer = convert_embedded_model()  # the embedded model's local HF folder
    model = served_model(url)
    total = args.clients * args.requests
    out = args.out or Path(tempfile.mkdtemp(prefix="guidellm-")) / "benchmarks.json"
    command = guidellm_command(args.guidellm, url, model, tokenizer, args.clients, total,
                               args.max_tokens, args.prompt_tokens, stream, args.max_seconds,
                               out)
    print("+", " ".join(command), flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(command, env=env, check=False)
    if done.returncode != 0 or not out.exists():
        print(f"GuideLLM failed (exit {done.returncode})", file=sys.stderr)
        return 1
    theirs = guidellm_summary(json.loads(out.read_text()), stream)
    print(f"\nour load test, same server, same load: {args.clients} clients x "
          f"{args.requests} requests x {args.max_tokens} tokens, stream={stream}", flush=True)
    ours = run_load(url, args.clients, args.requests, args.max_tokens, stream=stream,
                    timeout=args.max_seconds, deadline=args.max_seconds, model=model)
    print(format_table(ours))
    print(f"\n{side_by_side(ours, theirs)}\n\nGuideLLM's JSON: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--chapter", help="01..06: start that chapter's server")
    where.add_argument("--url", help="a running OpenAI-compatible server")
    p.add_argument("--clients", type=int, default=8, help="concurrent streams")
    p.add_argument("--requests", type=int, default=2, help="per client")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--prompt-tokens", type=int, default=8, help="GuideLLM's synthetic prompts")
    p.add_argument("--max-seconds", type=float, default=600.0, help="per run, s")
    p.add_argument("--no-stream", action="store_true", help="--url: whole answers")
    p.add_argument("--dtype", default="float32", help="--chapter: its server's dtype")
    p.add_argument("--device-memory-gb", help="--chapter: its server's card")
    p.add_argument("--guidellm", type=Path, default=GUIDELLM, help="the guidellm command")
    p.add_argument("--out", type=Path, help="GuideLLM's JSON (default: a temporary folder)")
    args = p.parse_args(argv)
    if not args.guidellm.exists():
        print(f"error: {args.guidellm} is missing: `make guidellm` installs it",
              file=sys.stderr)
        return 2
    if args.url:
        return run(args.url.rstrip("/"), args, stream=not args.no_stream)
    chapter = f"{int(args.chapter):02d}"
    server_args = ["--dtype", args.dtype]
    if args.device_memory_gb:
        server_args += ["--device-memory-gb", str(args.device_memory_gb)]
    log = Path(tempfile.gettempdir()) / f"guidellm-ch{chapter}.log"
    with ChapterServer(chapter, free_port(), server_args, log) as server:
        print(f"chapter {chapter}'s server on {server.url} (log: {log})", flush=True)
        return run(server.url, args, stream=chapter in STREAMING_CHAPTERS)


if __name__ == "__main__":
    raise SystemExit(main())
