"""`make bench-adapters` (part of `make bench`): three ways to serve N fine-tunes, measured.

For N = 1, 4 and 8 adapters (seeded random LoRA adapters of rank 8 on
every projection, the shape of chapter 10's trained ones), the same
mixed traffic: 32 streaming clients, each sending its requests one after
another, request r of client c for adapter (c + r) % N. Three ways to
serve it, every row in one run on this machine:

- **multi-LoRA**: one chapter 10 server, `--enable-lora --max-loras N`:
  one copy of the base weights and N adapter slots; a step mixes adapters;
- **merged, one at a time**: each adapter merged into its own copy of the
  weights (W + alpha / r * B A, a model folder of its own), the models
  served one after another by a chapter 10 server without LoRA, each on
  its adapter's requests (all at once, up to 32 in flight). The wall time
  counts every model's start (loading its weights: the switch), and a
  request's TTFT counts the time it waited for its model's turn, from the
  start of the run (the requests all exist at the start). The weights it
  needs on the card to answer every adapter without a switch: N copies;
- **base model alone**: the same traffic on the base model, no adapter:
  the floor that the other two cost more than. Measured once.
- **the real vLLM** (`--peers vllm`, with `make vllm`): `--enable-lora
  --max-loras N --max-lora-rank 8` with the same adapters and traffic.

Reported: output tok/s (all completion tokens / wall time), its ratio to
the base model's, TTFT and ITL p50, and the weights on the card: the base
model's parameters (in the dtype served) plus, for multi-LoRA, its slots
as the engine reports them (`/stats` lora_slot_bytes).

    python -m bench.adapters                       # N = 1 4 8, ~15 min on 2 cores
    python -m bench.adapters --adapters 4 --requests 1 --peers vllm

Results: bench/results/DATE-HOST-adapters.{json,md}.

Left out: adapters of different ranks in one run, non-uniform traffic
(a few popular adapters), CPU-memory caching of adapters beyond the
slots (`--max-cpu-loras`), GPU rows.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch
from safetensors.torch import load_file, save_file

from bench.loadtest import (ChapterServer, RequestResult, drive_clients, fetch_stats,
                            prompt_messages, stream_request, summarize)
from bench.peers import vllm_peer
from bench.record import RESULTS_DIR, bf16_words, record_head, render_again, write_results
from common.loader import convert_embedded_model
from common.lora.lora_model import LoRAModel
from common.net import free_port

TEMPLATE = Path(__file__).resolve().parents[1] / "10-adapters" / "adapters" / "pirate"
RANK = 8
BASE = "smollm2"  # the name our servers and the vLLM peer give the base model
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
               "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp",
               "down_proj": "mlp"}


# ------------------------------------------------------------ the adapters
def random_adapters(count: int, folder: Path, seed: int = 0) -> list[Path]:
    """`count` adapters shaped as chapter 10's trained ones (their config,
    their tensor names and shapes), with seeded random weights."""
    template = load_file(TEMPLATE / "adapter_model.safetensors")
    paths = []
    for i in range(count):
        gen = torch.Generator().manual_seed(seed + i)
        weights = {name: (torch.randn(t.shape, generator=gen) * 0.02).to(t.dtype)
                   for name, t in sorted(template.items())}
        path = folder / f"adapter-{i}"
        path.mkdir(parents=True)
        save_file(weights, path / "adapter_model.safetensors")
        shutil.copy(TEMPLATE / "adapter_config.json", path)
        paths.append(path)
    return paths


def merged_model(adapter: Path, folder: Path) -> Path:
    """The base model's folder with `adapter` merged into its weights."""
    base = convert_embedded_model()
    weights = load_file(Path(base) / "model.safetensors")
    lora = LoRAModel.from_local_checkpoint(adapter, 1, RANK, torch.float32)
    for (layer, name), change in lora.loras.items():
        key = f"model.layers.{layer}.{PROJECTIONS[name]}.{name}.weight"
        delta = change.scaling * change.lora_b @ change.lora_a  # (out, in)
        weights[key] = (weights[key].float() + delta).to(weights[key].dtype)
    folder.mkdir(parents=True)
    for item in Path(base).iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, folder)
    save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    return folder


def weight_bytes(dtype: str) -> int:
    """The base model's parameters, in the dtype served."""
    weights = load_file(Path(convert_embedded_model()) / "model.safetensors")
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return sum(t.numel() for t in weights.values()) * size


# ------------------------------------------------------------ the traffic
def chat(url: str, model: str | None, index: int, max_tokens: int) -> RequestResult:
    body = {"messages": prompt_messages(index), "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True} | ({"model": model} if model else {})
    try:
        return stream_request(url.rstrip("/") + "/v1/chat/completions", body, 600)[0]
    except requests.RequestException as exc:
        return RequestResult(False, f"{type(exc).__name__}: {exc}")


def requests_of(args, names: list[str]) -> list[tuple[int, int, str]]:
    """(client, request, adapter name) of the whole run: the mixed traffic."""
    return [(c, r, names[(c + r) % len(names)])
            for c in range(args.clients) for r in range(args.requests)]


def mixed_load(url: str, args, names: list[str | None]) -> dict:
    """Every client at once, client c's r-th request for names[(c + r) % N]."""
    def send(c: int, r: int) -> RequestResult:
        return chat(url, names[(c + r) % len(names)], c * args.requests + r, args.max_tokens)

    results, wall = drive_clients(args.clients, send, lambda r, _: r < args.requests)
    return summarize(results, wall)


# ------------------------------------------------------------ the rows
def server(args, extra: list[str], log_dir: Path, name: str) -> ChapterServer:
    return ChapterServer("10", free_port(), ["--dtype", args.dtype, *extra],
                         log_dir / f"{name}.log")


def lora_flags(paths: list[Path]) -> list[str]:
    return ["--enable-lora", "--max-loras", str(len(paths)), "--max-lora-rank", str(RANK),
            "--lora-modules", *[f"a{i}={p}" for i, p in enumerate(paths)]]


def base_row(args, log_dir: Path) -> dict:
    with server(args, [], log_dir, "base") as s:
        summary = mixed_load(s.url, args, [None])
    return {"way": "base model alone", "adapters": 0, **summary,
            "weight_bytes": weight_bytes(args.dtype)}


def multi_lora_row(args, paths: list[Path], log_dir: Path) -> dict:
    names = [f"a{i}" for i in range(len(paths))]
    with server(args, lora_flags(paths), log_dir, f"lora-{len(paths)}") as s:
        summary = mixed_load(s.url, args, names)
        slots = (fetch_stats(s.url) or {}).get("lora_slot_bytes", 0)
    return {"way": "multi-LoRA", "adapters": len(paths), **summary,
            "weight_bytes": weight_bytes(args.dtype) + slots, "lora_slot_bytes": slots}


def merged_row(args, paths: list[Path], log_dir: Path, work: Path) -> dict:
    """Each merged model in turn, on its adapter's share of the traffic."""
    jobs = requests_of(args, [str(i) for i in range(len(paths))])
    results: list[RequestResult] = []
    switches = []
    start = time.perf_counter()
    for i, adapter in enumerate(paths):
        began = time.perf_counter()
        folder = merged_model(adapter, work / f"merged-{len(paths)}-{i}")
        with server(args, ["--model", str(folder), "--served-model-name", BASE], log_dir,
                    f"merged-{len(paths)}-{i}") as s:
            switches.append(time.perf_counter() - began)
            waited = time.perf_counter() - start  # this model's turn came now
            mine = [(c, r) for c, r, name in jobs if name == str(i)]
            with ThreadPoolExecutor(min(args.clients, len(mine))) as pool:
                done = list(pool.map(lambda job: chat(s.url, None, job[0] * args.requests + job[1],
                                                      args.max_tokens), mine))
        for result in done:
            if result.ttft is not None:
                result.ttft += waited
        results += done
        shutil.rmtree(folder)
    summary = summarize(results, time.perf_counter() - start)
    return {"way": "merged, one at a time", "adapters": len(paths), **summary,
            "weight_bytes": weight_bytes(args.dtype) * len(paths),
            "switch_s": switches}


def vllm_row(args, paths: list[Path], log_dir: Path) -> dict:
    names = [f"a{i}" for i in range(len(paths))]
    extra = lora_flags(paths)
    with vllm_peer.VllmServer(free_port(), log_dir / f"vllm-{len(paths)}.log", args.dtype,
                              extra=extra) as s:
        summary = mixed_load(s.url, args, names)
    return {"way": f"vLLM {vllm_peer.installed_version()} multi-LoRA", "adapters": len(paths),
            **summary, "weight_bytes": None, "command": s.shown}


# ------------------------------------------------------------ the record
def ms(value) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def markdown(record: dict) -> str:
    m, load = record["machine"], record["load"]
    base = next(r for r in record["rows"] if r["adapters"] == 0)
    lines = [f"# Serving N adapters: multi-LoRA, merged models, the base model "
             f"({record['date'][:10]})", "",
             f"{m['cpu']}, {m['cores']} cores, {bf16_words(m)}; {load['dtype']}; "
             f"`{record['command']}`", "",
             f"{load['clients']} streaming clients x {load['requests']} requests x "
             f"{load['max_tokens']} tokens, request r of client c for adapter (c + r) % N; "
             "TTFT of the merged models counts the wait for a request's model.", "",
             "| N | way | output tok/s | vs base | TTFT p50 ms | ITL p50 ms | weights MB |",
             "|---|---|---|---|---|---|---|"]
    for row in record["rows"]:
        ratio = row["output_tokens_per_s"] / base["output_tokens_per_s"]
        weights = "-" if row["weight_bytes"] is None else f"{row['weight_bytes'] / 1e6:.1f}"
        failed = f" ({row['failed']} failed)" if row["failed"] else ""
        lines.append(f"| {row['adapters']} | {row['way']}{failed} | "
                     f"{row['output_tokens_per_s']:.1f} | {ratio:.2f} | {ms(row['ttft_p50_s'])} | "
                     f"{ms(row['itl_p50_s'])} | {weights} |")
    for row in record["rows"]:
        if row.get("switch_s"):
            lines.append(f"\nMerged, N = {row['adapters']}: each model's start (merge, "
                         f"load) took {min(row['switch_s']):.1f}-{max(row['switch_s']):.1f} s.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=2, help="per client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--peers", nargs="*", default=[], choices=["vllm"])
    p.add_argument("--skip-merged", action="store_true")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--render", type=Path, default=None, metavar="JSON",
                   help="measure nothing: write the markdown of a results file again")
    args = p.parse_args(argv)
    if args.render:
        render_again(args.render, markdown)
        return 0
    use_vllm = "vllm" in args.peers and not vllm_peer.missing()
    record = {**record_head(" ".join(["python -m bench.adapters", *(argv or sys.argv[1:])])),
              "load": {"clients": args.clients, "requests": args.requests,
                       "max_tokens": args.max_tokens, "dtype": args.dtype}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="bench-adapters-") as tmp:
        work = Path(tmp)
        record["rows"].append(base_row(args, work))
        paths = random_adapters(max(args.adapters), work / "adapters")
        for n in args.adapters:
            record["rows"].append(multi_lora_row(args, paths[:n], work))
            if not args.skip_merged:
                record["rows"].append(merged_row(args, paths[:n], work, work))
            if use_vllm:
                record["rows"].append(vllm_row(args, paths[:n], work))
    if use_vllm:
        record["machine"]["vllm"] = vllm_peer.installed_version()
    write_results(args.out_dir, "adapters", record, markdown(record))
    print(json.dumps({"rows": len(record["rows"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
