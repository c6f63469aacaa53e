"""The course's pictures: drawn with matplotlib from the engine's own traces
and the results files, each from its data file in pictures/data/.

    python -m pictures.make.pictures --record   # make traces: run the engine, write the data
    python -m pictures.make.pictures            # make pictures: draw every PNG from the data only
    python -m pictures.make.pictures --check    # change nothing: the pictures whose data changed

What it draws (`PICTURES`, one data file or two each):

- kv-pool-ch03/04/05.png: the KV pool over time, the same load on chapters
  03, 04 and 05: engine step by block, each block coloured by the request
  that holds it, prefix blocks shared by several requests in grey, blocks
  reused from the prefix cache dotted, free blocks blank
  (kv-trace-ch03/04/05.json);
- timeline-ch04-vs-ch05.png, timeline-preemption.png: one row per request,
  what it does at each step (waiting, a prefill chunk, its last prefill,
  decode, preempted, recompute) (kv-trace-ch04.json + kv-trace-ch05.json;
  kv-trace-preemption.json);
- card.png: the demo card as stacked bars, weights, activations and KV
  (chapter 03's one 8192-token region against chapter 04's 537 blocks, then
  int4 and one of three tensor-parallel cards) (card.json);
- engine-map-ch01..10.png: the engine's parts, that chapter's highlighted,
  the later chapters' greyed (engine-map.json, written by hand: each box
  with the file it lives in and the chapter that adds it);
- lora-products.png: chapter 10's step, one base product for the whole
  batch and a thin product per adapter (lora-products.json, written by
  hand; drawn by lora_products.py).

Where the data come from: `--record` runs the real engine in-process
(`LLMEngine`, the embedded SmolLM2, float32, CPU) and records each step
from the scheduler's own batch (its `schedule` wrapped, nothing else
changed): the batch, the queues, every running request's block table,
the shared blocks and the free list. card.json is the arithmetic of
common/memory.py (activations, bytes per token) checked against the
results files it names (weights and blocks as measured). Drawing reads
only pictures/data/: the same data give the same bytes, and each PNG
keeps the sha256 of its data files in a text chunk, so `--check` (and
tests/test_pictures.py) finds a picture not redrawn after its data changed.

The KV pool of a live view's recording (`--record-events FILE`, the
engine's step events) draws the same way: `--recording FILE --out PNG`.

Left out: time in seconds (a step's length depends on the machine; the
x axis is the engine step), the tokens' text, speculative and structured
steps (chapter 07), the tensor-parallel ranks' own pools. The traces run
with `max_model_len` 128, so that chapter 03's region (8192 slots by
default) fits the picture beside chapter 04's blocks.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from pictures.make.lora_products import draw_lora_products

ROOT = Path(__file__).resolve().parents[2]
PICTURES_DIR = ROOT / "pictures"
DATA_DIR = PICTURES_DIR / "data"
RESULTS_DIR = ROOT / "bench" / "results"
CHAPTERS = ["01", "02", "03", "04", "05", "06", "07", "08", "09", "10"]
COMMAND = "python -m pictures.make.pictures --record"

# --------------------------------------------------------------- the load
CELL = 16  # tokens in one cell of the pool pictures: one block of chapters 04-05


def cell_tokens(engine: dict) -> int:
    """Tokens per cell: CELL, or a whole block when blocks are smaller (a recording's)."""
    return min(CELL, engine["block_size"])


@dataclass(frozen=True)
class Load:
    """The same small load for every trace: chat requests that share the
    load test's system prompt, greedy, EOS ignored, one arriving per step."""
    requests: int = 8
    max_tokens: int = 24
    arrivals_per_step: int = 1
    max_model_len: int = 128  # chapter 03's region; 8192 by default
    long_prefill_token_threshold: int = 32  # chapter 05 feeds a prompt in chunks of 32

    def arrival_step(self, i: int) -> int:
        return 1 + i // self.arrivals_per_step


LOAD = Load()
PREEMPTION_LOAD = Load(requests=4, max_tokens=48)

@dataclass(frozen=True)
class Run:
    """One trace: a chapter's engine (its scheduler and settings, a pool of
    `num_blocks`) under a load."""
    chapter: str
    scheduler: str  # a class of common/core/scheduler.py
    settings: dict  # EngineConfig fields
    num_blocks: int
    load: Load
    title: str


PAGED = dict(block_size=16, enable_prefix_caching=True)
RUNS = {
    "ch03": Run("03", "StaticScheduler", dict(max_num_seqs=1, block_size=None), 3, LOAD,
                "one request at a time, each in a region of max_model_len slots"),
    "ch04": Run("04", "StaticScheduler", PAGED, 24, LOAD,
                "blocks of 16 tokens, prefix caching, static batches"),
    "ch05": Run("05", "ContinuousScheduler", PAGED, 24, LOAD,
                "blocks of 16 tokens, prefix caching, continuous batching"),
    "preemption": Run("05", "ContinuousScheduler", PAGED, 12, PREEMPTION_LOAD,
                      "too few blocks: the newest request is preempted"),
}


# ------------------------------------------------------- recording a trace
def batch_kind(item, admitted: bool) -> str:
    """What a scheduled sequence does this step, from the scheduler's item
    (`admitted`: it joined the running batch at this step)."""
    seq = item.seq
    if seq.num_preemptions and (admitted or seq.num_computed_tokens < seq.num_tokens - 1):
        return "recompute"  # its prompt and output so far, after a preemption
    if seq.num_output_tokens and seq.num_computed_tokens == seq.num_tokens - 1:
        return "decode"
    return "prefill" if item.samples else "chunk"


def step_record(engine, batch, running_before: list[str]) -> dict:
    """The pool and the queues as the forward pass sees them: after the
    scheduler's decision, before the model runs."""
    scheduler, bm = engine.scheduler, engine.block_manager
    fed = {item.seq.request_id: item.num_new_tokens for item in batch}
    running = scheduler.running
    return {
        "batch": [[item.seq.request_id,
                   batch_kind(item, item.seq.request_id not in running_before),
                   item.seq.num_computed_tokens, item.num_new_tokens] for item in batch],
        "running": [seq.request_id for seq in running],
        "waiting": [seq.request_id for seq in scheduler.waiting],
        "tables": {seq.request_id: list(seq.block_table) for seq in running},
        "tokens": {seq.request_id: seq.num_computed_tokens + fed.get(seq.request_id, 0)
                   for seq in running},  # tokens in the cache once the step has run
        "cached": {seq.request_id: seq.num_cached_tokens // bm.block_size for seq in running
                   if seq.num_cached_tokens},  # leading blocks found in the prefix cache
        "shared": [[block.block_id, block.ref_count] for block in bm.blocks
                   if block.ref_count > 1],
        "free": sorted(bm.free_blocks),
        "preemptions": scheduler.num_preemptions,
    }


class StepRecorder:
    """Wraps `engine.scheduler.schedule`: one record per step, from the
    batch the scheduler itself returned."""

    def __init__(self, engine):
        self.engine, self.steps = engine, []
        self._schedule = engine.scheduler.schedule
        engine.scheduler.schedule = self._recording_schedule

    def _recording_schedule(self):
        batch = self._schedule()
        before = self.steps[-1]["running"] if self.steps else []
        self.steps.append({"step": len(self.steps) + 1,
                           **step_record(self.engine, batch, before)})
        return batch

    def close(self) -> list[dict]:
        self.engine.scheduler.schedule = self._schedule
        return self.steps


def trace_from_recording(path: Path) -> dict:
    """A live view's recording (`--record-events FILE`: the engine's own step
    events, common/metrics/step_events.py) as a trace `draw_kv_pool` reads:
    the pool after each step, each running request's table and tokens."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    config, frames = lines[0], [f for f in lines[1:] if f.get("type") == "step"]
    order: dict[str, None] = {}  # request ids, by first appearance
    steps = []
    for frame in frames:
        for row in frame["running"] + frame["waiting"] + frame["preempted"]:
            order.setdefault(row["request_id"])
        running = frame["running"]
        steps.append({
            "step": frame["step"],
            "tables": {r["request_id"]: r["block_table"] for r in running},
            "tokens": {r["request_id"]: r["num_computed_tokens"] for r in running},
            "cached": {r["request_id"]: r["num_cached_tokens"] // frame["block_size"]
                       for r in running if r["num_cached_tokens"]},
            "shared": [[block, 2] for block, letter in enumerate(frame["blocks"])
                       if letter == "s"],
            "preemptions": frame["figures"]["num_preemptions"]})
    return {"engine": {"chapter": config.get("chapter", "?"), **config},
            "requests": [{"id": rid} for rid in order],
            "load": {"requests": len(order), "recording": "--record-events"},
            "steps": steps}


def draw_recording(recording: Path, out: Path) -> Path:
    """`--recording FILE --out PNG`: the KV pool over a recording's steps."""
    fig = draw_kv_pool([trace_from_recording(recording)])
    fig.savefig(out, dpi=DPI)
    return out


def load_prompts(tokenizer, load: Load) -> list[list[int]]:
    from bench.loadtest import prompt_messages
    from common.loader import apply_chat_template
    return [apply_chat_template(tokenizer, prompt_messages(i)) for i in range(load.requests)]


def drive(engine, prompts: list[list[int]], load: Load) -> list[dict]:
    """Run the load to the end, adding each request before its arrival step."""
    from common.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=load.max_tokens, ignore_eos=True)
    recorder = StepRecorder(engine)
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        step = len(recorder.steps) + 1
        while pending and load.arrival_step(pending[0][0]) <= step:
            i, prompt = pending.pop(0)
            engine.check_request(len(prompt), params)
            engine.add_request(f"r{i}", prompt, params)
        engine.step()
    return recorder.close()


def record_run(name: str, loaded) -> dict:
    """One chapter's engine under its load: the trace as a JSON-able dict."""
    from common.config import EngineConfig
    from common.core import scheduler as schedulers
    from common.engine.parts import EngineParts, assemble_engine
    run = RUNS[name]
    load = run.load
    config = EngineConfig(model="smollm2", dtype="float32", device="cpu",
                          max_model_len=load.max_model_len,
                          long_prefill_token_threshold=load.long_prefill_token_threshold,
                          **run.settings)
    engine = assemble_engine(config, EngineParts(scheduler_cls=getattr(schedulers, run.scheduler)),
                             loaded=loaded, num_blocks=run.num_blocks)
    prompts = load_prompts(loaded.tokenizer, load)
    steps = drive(engine, prompts, load)
    engine.close()
    return {
        "what": f"chapter {run.chapter}'s engine, step by step: {run.title}",
        "command": COMMAND,
        "engine": {"chapter": run.chapter, "scheduler": run.scheduler, "model": "smollm2",
                   "dtype": "float32", "device": "cpu", "block_size": engine.block_size,
                   "num_blocks": run.num_blocks, "max_num_seqs": config.max_num_seqs,
                   "max_num_batched_tokens": config.max_num_batched_tokens,
                   "long_prefill_token_threshold": engine.scheduler.long_prefill_token_threshold,
                   "enable_prefix_caching": config.enable_prefix_caching,
                   "max_model_len": load.max_model_len},
        "load": {"requests": load.requests, "max_tokens": load.max_tokens,
                 "prompts": "bench.loadtest.prompt_messages(i): its system prompt + question i",
                 "sampling": "greedy, ignore_eos", "arrivals_per_step": load.arrivals_per_step},
        "requests": [{"id": f"r{i}", "arrival_step": load.arrival_step(i),
                      "prompt_tokens": len(prompt)} for i, prompt in enumerate(prompts)],
        "steps": steps,
    }


def latest_results(pattern: str) -> Path:
    found = sorted(RESULTS_DIR.glob(pattern))
    if not found:
        raise FileNotFoundError(f"no bench/results/{pattern}")
    return found[-1]


def samples_with(capture: str) -> Path:
    """The newest samples file (`make samples`) that holds `capture`."""
    for path in sorted(RESULTS_DIR.glob("*-samples.json"), reverse=True):
        if capture in json.loads(path.read_text())["samples"]:
            return path
    raise FileNotFoundError(f"no bench/results/*-samples.json holds {capture!r}")


def stats_after_load(samples: dict, capture: str) -> dict:
    """The /stats JSON a samples capture ends with."""
    text = samples["samples"][capture]["text"]
    return json.loads(text.split("/stats after the load: ", 1)[1])


OOM_MESSAGE = re.compile(r"Tried to allocate ([\d.]+) MiB .*?([\d.]+) MiB total .*?"
                         r"([\d.]+) MiB already allocated; ([\d.]+) MiB free")


def ch02_crash(samples_path: Path) -> dict:
    """Chapter 02's second request on the demo card, from the error it got
    (the samples' "ch02-two-at-once": two requests at once, one fails)."""
    text = json.loads(samples_path.read_text())["samples"]["ch02-two-at-once"]["text"]
    request, budget, allocated, free = map(float, OOM_MESSAGE.search(text).groups())
    return {"request_mib": request, "budget_mib": budget, "allocated_mib": allocated,
            "free_mib": free, "weights_mib": round(allocated - request, 2),
            "source": f"{samples_path.relative_to(ROOT)} (ch02-two-at-once, the error message)"}


def card_data() -> dict:
    """The demo card's bars: the arithmetic of common/memory.py, each
    figure checked against the results file that measured it."""
    import torch
    from transformers import AutoConfig

    from common.config import EngineConfig
    from common.loader import convert_embedded_model
    from common.memory import GiB, MiB, activation_bytes_estimate, kv_bytes_per_token

    levers_path = latest_results("*-levers.json")
    tp_path = latest_results("*-tensor-parallel.json")
    samples_path = samples_with("ch03-log-2x64")
    levers = {row["lever"]: row for row in json.loads(levers_path.read_text())["rows"]}
    card_gb = json.loads(levers_path.read_text())["settings"]["card_gb"]
    tp_rank = {row["tp"]: row for row in json.loads(tp_path.read_text())["rows"]}[3]["ranks"][0]
    ch03 = stats_after_load(json.loads(samples_path.read_text()), "ch03-log-2x64")
    config = AutoConfig.from_pretrained(convert_embedded_model())
    per_token = kv_bytes_per_token(config, torch.float32)
    batched = EngineConfig().max_num_batched_tokens
    utilization = EngineConfig().gpu_memory_utilization
    budget = int(card_gb * GiB * utilization)

    def bar(label: str, weights_mib: float, tp: int, block_tokens: int, blocks: int) -> dict:
        activations = activation_bytes_estimate(config, batched, torch.float32, tp)
        block = per_token // tp * block_tokens
        room = (budget - int(weights_mib * MiB) - activations) // block
        if room != blocks:  # the arithmetic must give what the engine measured
            raise ValueError(f"{label}: the arithmetic gives {room} blocks, the results {blocks}")
        return {"label": label, "weights_mib": round(weights_mib, 2),
                "activations_mib": round(activations / MiB, 2),
                "kv_mib": round(blocks * block / MiB, 2), "kv_blocks": blocks,
                "block_tokens": block_tokens, "kv_tokens": blocks * block_tokens}

    f32, int4 = levers["float32"], levers["int4"]
    return {
        "what": "the demo card: what the engine puts on it, per card",
        "command": COMMAND,
        "card_mib": round(card_gb * GiB / MiB, 2),
        "budget_mib": round(budget / MiB, 2),
        "gpu_memory_utilization": utilization,
        "model": "SmolLM2-135M-Instruct (embedded), float32 KV cache",
        "kv_bytes_per_token": per_token,
        "activations": f"common.memory.activation_bytes_estimate, {batched} tokens a step",
        "bars": [
            bar("ch03: one region of 8192 tokens", f32["weights_mib"], 1, ch03["block_size"],
                ch03["num_blocks"]),
            bar("ch04-05: blocks of 16 tokens", f32["weights_mib"], 1, 16, f32["kv_blocks"]),
            bar("ch08: --quantization int4", int4["weights_mib"], 1, 16, int4["kv_blocks"]),
            bar("ch08: -tp 3, one of 3 cards", tp_rank["weights_mib"], 3, 16,
                tp_rank["kv_blocks"]),
        ],
        "ch02": ch02_crash(samples_with("ch02-two-at-once")),
        "sources": {
            "ch03 region": f"{samples_path.relative_to(ROOT)} (ch03-log-2x64, /stats)",
            "weights, blocks": f"{levers_path.relative_to(ROOT)} (rows float32, int4)",
            "tensor parallel": f"{tp_path.relative_to(ROOT)} (tp 3, rank 0)",
        },
    }


def dumps(data: dict) -> str:
    """Deterministic JSON: the top level indented, one step per line."""
    lines = []
    for key, value in data.items():
        if key == "steps":
            rows = ",\n  ".join(json.dumps(step, separators=(",", ":")) for step in value)
            lines.append(f' "steps": [\n  {rows}\n ]')
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def record(data_dir: Path = DATA_DIR) -> None:
    """`make traces`: run the engine for every trace, then the card's file."""
    from common.loader import load_model
    data_dir.mkdir(parents=True, exist_ok=True)
    loaded = load_model("smollm2", "float32", "cpu", "auto", 0)
    for name in RUNS:
        trace = record_run(name, loaded)
        (data_dir / f"kv-trace-{name}.json").write_text(dumps(trace))
        print(f"[pictures] kv-trace-{name}.json: {outcome(trace)}", flush=True)
    (data_dir / "card.json").write_text(dumps(card_data()))
    print("[pictures] card.json", flush=True)


# ---------------------------------------------------------------- drawing
WIDTH_IN, DPI = 9.0, 100  # 900 px: the README's width
REQUEST_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                   "#e377c2", "#bcbd22", "#17becf", "#7f7f7f"]
SHARED_COLOUR = "#404040"
STATE_COLOURS = {"waiting": "#d9d9d9", "chunk": "#9ecae1", "prefill": "#2171b5",
                 "decode": "#41ab5d", "preempted": "#ef3b2c", "recompute": "#fd8d3c",
                 "running, not in the batch": "#fff2ae"}
STATE_LABELS = {"waiting": "waiting", "chunk": "prefill chunk (no sample)",
                "prefill": "prefill (last chunk, samples)", "decode": "decode (1 token)",
                "preempted": "preempted, waiting again", "recompute": "recompute after preemption",
                "running, not in the batch": "running, not in this step"}


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "figure.dpi": DPI,
                         "savefig.dpi": DPI, "font.family": "DejaVu Sans"})
    return plt


def request_colour(requests: list[dict], request_id: str) -> str:
    """A request's colour: by its place in the load, the same in every picture."""
    index = [r["id"] for r in requests].index(request_id)
    return REQUEST_COLOURS[index % len(REQUEST_COLOURS)]


def chapter_heading(trace: dict) -> str:
    engine = trace["engine"]
    return f"Chapter {engine['chapter']} ({engine['scheduler']})"


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def load_line(trace: dict) -> str:
    load = trace["load"]
    if "recording" in load:  # a live view's recording: no load description
        return f"{plural(load['requests'], 'request')}, recorded by {load['recording']}"
    return (f"{load['requests']} chat requests sharing a system prompt, {load['max_tokens']} "
            f"greedy tokens each, {load['arrivals_per_step']} arriving per step")


def outcome(trace: dict) -> str:
    steps = trace["steps"]
    return f"{plural(len(steps), 'step')}, {plural(steps[-1]['preemptions'], 'preemption')}"


def pool_line(trace: dict) -> str:
    engine = trace["engine"]
    if engine["block_size"] > CELL:
        return (f"{engine['num_blocks']} regions of max_model_len = {engine['block_size']} "
                "slots (8192 by default)")
    caching = ", prefix caching" if engine["enable_prefix_caching"] else ""
    return f"{engine['num_blocks']} blocks of {engine['block_size']} tokens{caching}"


# -- the KV pool
def pool_cells(trace: dict):
    """The pool as an RGB image, one 16-token cell by step; the cells
    reused from the prefix cache (dots); whether any cell is reserved and
    still empty (pale)."""
    import numpy as np
    from matplotlib.colors import to_rgb
    engine, requests, steps = trace["engine"], trace["requests"], trace["steps"]
    tokens_per_cell = cell_tokens(engine)
    per_block = engine["block_size"] // tokens_per_cell
    image = np.ones((engine["num_blocks"] * per_block, len(steps), 3))
    dots, pale = [], False
    for x, step in enumerate(steps):
        shared = {block for block, _ in step["shared"]}
        for rid, table in step["tables"].items():
            colour = np.array(to_rgb(request_colour(requests, rid)))
            tokens, hits = step["tokens"][rid], step["cached"].get(rid, 0)
            for j, block in enumerate(table):
                for k in range(per_block):
                    cell = block * per_block + k
                    filled = tokens - (j * per_block + k) * tokens_per_cell > 0
                    pale = pale or not filled
                    if block in shared:
                        image[cell, x] = to_rgb(SHARED_COLOUR)
                    else:  # a reserved cell that holds no token yet: pale
                        image[cell, x] = colour if filled else 0.3 * colour + 0.7
                    if j < hits:
                        dots.append((x + 1, cell, block in shared))
    return image, dots, pale


def pool_legend(trace: dict, pale: bool) -> list:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    requests = trace["requests"]
    handles = [Patch(color=request_colour(requests, r["id"]), label=r["id"]) for r in requests]
    handles.append(Patch(facecolor="white", edgecolor="grey", label="free"))
    if pale:
        handles.append(Patch(color="#dddddd", label="pale: reserved,\nno token yet"))
    if trace["engine"]["enable_prefix_caching"]:
        handles.append(Patch(color=SHARED_COLOUR, label="prefix block read\nby 2+ requests"))
        handles.append(Line2D([], [], color="black", marker="o", linestyle="", markersize=3,
                              label="reused from the\nprefix cache"))
    return handles


def draw_kv_pool(traces: list[dict]):
    plt = pyplot()
    trace = traces[0]
    engine, steps = trace["engine"], trace["steps"]
    per_block = engine["block_size"] // cell_tokens(engine)
    image, dots, pale = pool_cells(trace)
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 5.2))
    ax.imshow(image, aspect="auto", interpolation="nearest", origin="lower",
              extent=(0.5, len(steps) + 0.5, -0.5, image.shape[0] - 0.5))
    if dots:
        xs, ys, on_shared = zip(*dots)
        ax.scatter(xs, ys, s=4, c=["white" if dark else "black" for dark in on_shared],
                   marker="o", linewidths=0)
    for boundary in range(1, image.shape[0]):
        region = per_block > 1 and boundary % per_block == 0
        ax.axhline(boundary - 0.5, color="black" if region else "#cccccc",
                   linewidth=1.2 if region and per_block > 1 else 0.4)
    ax.set_xlabel("engine step")
    if per_block > 1:
        ax.set_ylabel(f"16-token slice of the cache\n({engine['num_blocks']} regions of "
                      f"{engine['block_size']} slots)")
    else:
        ax.set_ylabel(f"block id ({engine['block_size']} tokens each)")
    ax.set_xlim(0.5, len(steps) + 0.5)
    fig.suptitle(f"{chapter_heading(trace)}: the KV pool, step by step", fontsize=12)
    ax.set_title(f"{pool_line(trace)}; {outcome(trace)}\n{load_line(trace)}", fontsize=9)
    ax.legend(handles=pool_legend(trace, pale), loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize=8.5, frameon=False)
    fig.tight_layout()
    return fig


# -- the timelines
def request_states(trace: dict) -> dict[str, list[str | None]]:
    """Each request's state at each step (None: not arrived, or finished)."""
    states = {r["id"]: [None] * len(trace["steps"]) for r in trace["requests"]}
    preempted: set[str] = set()
    for x, step in enumerate(trace["steps"]):
        kinds = {rid: kind for rid, kind, _, _ in step["batch"]}
        for rid in step["waiting"]:
            states[rid][x] = "preempted" if rid in preempted else "waiting"
        for rid in step["running"]:
            states[rid][x] = kinds.get(rid, "running, not in the batch")
        for rid, kind in kinds.items():
            if kind == "recompute":
                preempted.discard(rid)
        for rid in step["waiting"]:
            if x and rid in trace["steps"][x - 1]["running"]:
                preempted.add(rid)
                states[rid][x] = "preempted"
    return states


def runs_of(values: list) -> list[tuple[int, int, object]]:
    """(start, length, value) for each run of equal values."""
    out, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            out.append((start, i - start, values[start]))
            start = i
    return out


def draw_timeline_axis(ax, trace: dict, used: set) -> None:
    states = request_states(trace)
    ids = [r["id"] for r in trace["requests"]]
    for row, rid in enumerate(ids):
        for start, length, state in runs_of(states[rid]):
            if state is not None:
                ax.broken_barh([(start + 0.5, length)], (row - 0.38, 0.76),
                               facecolors=STATE_COLOURS[state], edgecolor="none")
                used.add(state)
    ax.set_yticks(range(len(ids)), ids)
    ax.set_ylim(len(ids) - 0.5, -0.5)
    ax.set_ylabel("request")
    ax.set_title(f"{chapter_heading(trace)}: {pool_line(trace)}; {outcome(trace)}",
                 fontsize=9.5, loc="left")
    ax.grid(axis="x", color="#eeeeee", linewidth=0.6)
    ax.set_axisbelow(True)


def draw_timelines(traces: list[dict]):
    plt = pyplot()
    from matplotlib.patches import Patch
    rows = sum(len(t["requests"]) for t in traces)
    fig, axes = plt.subplots(len(traces), 1, sharex=True, squeeze=False,
                             figsize=(WIDTH_IN, 1.6 + 0.3 * rows + 0.5 * len(traces)),
                             height_ratios=[len(t["requests"]) for t in traces])
    used: set = set()
    for ax, trace in zip(axes[:, 0], traces):
        draw_timeline_axis(ax, trace, used)
    longest = max(len(t["steps"]) for t in traces)
    axes[-1, 0].set_xlim(0.5, longest + 0.5)
    axes[-1, 0].set_xlabel("engine step")
    handles = [Patch(color=STATE_COLOURS[s], label=STATE_LABELS[s]) for s in STATE_COLOURS
               if s in used]
    fig.legend(handles=handles, loc="lower center", ncol=min(4, len(handles)), fontsize=8.5,
               frameon=False)
    what = (" against ".join(chapter_heading(t).split(" (")[0] for t in traces)
            if len(traces) > 1 else "too few blocks, preemption and recompute")
    fig.suptitle(f"What each request does at each step: {what}\n"
                 f"{load_line(traces[0])}", fontsize=11)
    legend_rows = -(-len(handles) // 4)
    fig.tight_layout(rect=(0, (0.2 + 0.2 * legend_rows) / fig.get_figheight(), 1, 1))
    return fig


# -- the card
CARD_PARTS = [("weights_mib", "weights", "#6b6ecf", "white"),
              ("activations_mib", "activations", "#e7ba52", "black"),
              ("kv_mib", "KV cache", "#31a354", "white")]


def part_text(key: str, name: str, bar: dict) -> str:
    mib = bar[key]
    if key != "kv_mib":
        return f"{name}\n{mib:.0f} MiB" if mib > 90 else f"{mib:.0f}"
    what = "1 region" if bar["kv_blocks"] == 1 else f"{bar['kv_blocks']} blocks"
    return f"KV {mib:.0f} MiB = {what}\n{bar['kv_tokens']} tokens"


def draw_card_bar(ax, y: int, bar: dict, card: dict) -> None:
    left = 0.0
    for key, name, colour, ink in CARD_PARTS:
        ax.barh(y, bar[key], left=left, color=colour, edgecolor="white", height=0.62)
        ax.text(left + bar[key] / 2, y, part_text(key, name, bar), ha="center", va="center",
                fontsize=7.5, color=ink)
        left += bar[key]
    unused = card["budget_mib"] - left
    ax.text(card["card_mib"] + 10, y, f"{unused:.0f} MiB unused" if unused >= 1
            else "full:\n< 1 block left", va="center", fontsize=8)


def draw_card_limits(ax, card: dict) -> None:
    """The engine's share of the card (dashed) and the card itself (solid)."""
    top = ax.get_xaxis_transform()  # x in MiB, y in the axes' height
    ax.axvline(card["budget_mib"], color="black", linestyle="--", linewidth=1)
    ax.axvline(card["card_mib"], color="black", linewidth=1.5)
    ax.text(card["budget_mib"] - 5, 1.01, f"the engine's {card['gpu_memory_utilization']:.0%}: "
            f"{card['budget_mib']:.0f} MiB", transform=top, ha="right", va="bottom", fontsize=8)
    ax.text(card["card_mib"] + 5, 1.01, f"card: {card['card_mib']:.0f} MiB", transform=top,
            ha="left", va="bottom", fontsize=8)


def draw_card(data: list[dict]):
    plt = pyplot()
    card = data[0]
    bars = card["bars"]
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 4.4))
    ax.axvspan(card["budget_mib"], card["card_mib"], color="#eeeeee", zorder=0)
    for y, bar in enumerate(bars):
        draw_card_bar(ax, y, bar, card)
    draw_card_limits(ax, card)
    ax.set_yticks(range(len(bars)), [b["label"] for b in bars])
    ax.set_ylim(len(bars) - 0.5, -0.5)
    ax.set_xlim(0, card["card_mib"] * 1.17)
    ax.set_xlabel("MiB on one card")
    region, blocks = bars[0], bars[1]
    fig.suptitle(f"The demo card ({card['card_mib'] / 1024:.1f} GiB, float32): weights, "
                 "activations, KV cache", fontsize=12)
    fig.text(0.5, 0.905, f"Chapter 03 reserves one region of {region['kv_tokens']} slots per "
             f"request: one request fits. The same memory as {blocks['kv_blocks']} blocks of "
             f"{blocks['block_tokens']} tokens\nholds {blocks['kv_tokens']} tokens of any mix of "
             "requests; int4 weights and tensor parallelism leave room for more blocks.",
             ha="center", va="top", fontsize=8.5)
    ax.text((card["budget_mib"] + card["card_mib"]) / 2, len(bars) - 0.55,
            "not the\nengine's", ha="center", va="bottom", fontsize=7, color="#525252")
    fig.tight_layout(rect=(0, 0, 1, 0.87))
    return fig


def draw_card_ch02(data: list[dict]):
    """Chapter 02 on the demo card: the weights and the first request's
    static cache fit; the second request's does not (its error's figures)."""
    plt = pyplot()
    card = data[0]
    crash = card["ch02"]
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 2.7))
    ax.axvspan(card["budget_mib"], card["card_mib"], color="#eeeeee", zorder=0)
    left = 0.0
    for width, colour, text in [
            (crash["weights_mib"], "#6a6ad5", f"weights\n{crash['weights_mib']:.0f} MiB"),
            (crash["request_mib"], "#31a354",
             f"request 1: static cache\n+ activations, {crash['request_mib']:.2f} MiB")]:
        ax.barh(1, width, left=left, color=colour, edgecolor="white", height=0.55)
        ax.text(left + width / 2, 1, text, ha="center", va="center", fontsize=8, color="white")
        left += width
    ax.barh(0, crash["request_mib"], left=crash["allocated_mib"], color="#fcbba1",
            edgecolor="#cb181d", hatch="//", height=0.55)
    ax.text(crash["allocated_mib"] + crash["request_mib"] / 2, 0,
            f"request 2 asks {crash['request_mib']:.2f} MiB", ha="center", va="center",
            fontsize=8, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5})
    ax.text(crash["allocated_mib"] - 12, 0, f"only {crash['free_mib']:.2f} MiB free:\n"
            "CUDA out of memory", ha="right", va="center", fontsize=8.5, color="#cb181d")
    draw_card_limits(ax, card)
    ax.set_yticks([1, 0], ["on the card", "the second\nrequest"])
    ax.set_ylim(-0.55, 1.55)
    ax.set_xlim(0, crash["allocated_mib"] + crash["request_mib"] + 40)
    ax.set_xlabel("MiB on one card")
    fig.suptitle(f"Chapter 02 on the demo card ({card['card_mib'] / 1024:.1f} GiB, float32): "
                 "one request fits, the second does not", fontsize=11)
    fig.tight_layout()
    return fig


# -- the engine map
def box_style(box_chapter: str, chapter: str) -> dict:
    if box_chapter == chapter:
        return {"face": "#fdae6b", "edge": "#a63603", "text": "black", "file": "#4a1c00",
                "line": "solid", "width": 2.0}
    if box_chapter < chapter:
        return {"face": "#ffffff", "edge": "#525252", "text": "black", "file": "#525252",
                "line": "solid", "width": 1.0}
    return {"face": "#f0f0f0", "edge": "#bdbdbd", "text": "#a0a0a0", "file": "#bdbdbd",
            "line": "dashed", "width": 0.8}


def fitting_size(ax, text: str, width: float, most: float = 6.3) -> float:
    """The font size (points) at which a monospace `text` fits `width` data units."""
    (x0, _), (x1, _) = ax.transData.transform([(0, 0), (width, 0)])
    return min(most, 0.92 * (x1 - x0) / (0.6 * len(text)) * 72 / DPI)


def draw_box(ax, box: dict, chapter: str) -> None:
    from matplotlib.patches import FancyBboxPatch
    style = box_style(box["chapter"], chapter)
    x, y, w, h = box["x"], box["y"], box["w"], box["h"]
    path = box["file"].removeprefix("common/")
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                facecolor=style["face"], edgecolor=style["edge"],
                                linewidth=style["width"], linestyle=style["line"]))
    ax.text(x + w / 2, y + h * 0.56, box["label"], ha="center", va="center", fontsize=8.5,
            color=style["text"], weight="bold" if box["chapter"] == chapter else "normal")
    ax.text(x + w / 2, y + h * 0.15, path, ha="center", va="center",
            fontsize=fitting_size(ax, path, w), family="DejaVu Sans Mono", color=style["file"])
    ax.text(x + w - 0.04, y + h - 0.03, f"ch{box['chapter']}", ha="right", va="top",
            fontsize=6, color=style["file"])


def draw_engine_map(data: list[dict], chapter: str):
    plt = pyplot()
    from matplotlib.patches import Patch
    layout = data[0]
    width, height = layout["canvas"]
    fig, ax = plt.subplots(figsize=(WIDTH_IN, WIDTH_IN * (height + 0.6) / width))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    ax.set_title(f"Chapter {chapter}: {layout['chapters'][chapter]}", fontsize=12,
                 weight="bold")
    handles = [Patch(facecolor="#fdae6b", edgecolor="#a63603", label=f"added in chapter {chapter}")]
    if any(box["chapter"] < chapter for box in layout["boxes"]):
        handles.append(Patch(facecolor="white", edgecolor="#525252",
                             label="from earlier chapters"))
    if any(box["chapter"] > chapter for box in layout["boxes"]):
        handles.append(Patch(facecolor="#f0f0f0", edgecolor="#bdbdbd", linestyle="dashed",
                             label="later chapters"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.02), ncol=3,
              fontsize=8.5, frameon=False)
    fig.tight_layout()  # first: the boxes' file names are sized to the final axes
    for group in layout["groups"]:
        ax.text(group["x"], group["y"], group["label"], fontsize=8, color="#525252",
                style="italic", va="bottom")
    for box in layout["boxes"]:
        draw_box(ax, box, chapter)
    return fig


# ------------------------------------------------- the pictures and check
PICTURES = {
    "kv-pool-ch03.png": (["kv-trace-ch03.json"], draw_kv_pool),
    "kv-pool-ch04.png": (["kv-trace-ch04.json"], draw_kv_pool),
    "kv-pool-ch05.png": (["kv-trace-ch05.json"], draw_kv_pool),
    "timeline-ch04-vs-ch05.png": (["kv-trace-ch04.json", "kv-trace-ch05.json"], draw_timelines),
    "timeline-preemption.png": (["kv-trace-preemption.json"], draw_timelines),
    "card.png": (["card.json"], draw_card),
    "card-ch02.png": (["card.json"], draw_card_ch02),
    **{f"engine-map-ch{c}.png": (["engine-map.json"], partial(draw_engine_map, chapter=c))
       for c in CHAPTERS},
    "lora-products.png": (["lora-products.json"], draw_lora_products),  # ch10
}
STAMP = "data-sha256"  # the PNG text chunk: "file=sha256 file=sha256"


def data_stamp(names: list[str], data_dir: Path) -> str:
    return " ".join(f"{name}={hashlib.sha256((data_dir / name).read_bytes()).hexdigest()}"
                    for name in names)


def save_png(fig, path: Path, text: dict[str, str]) -> None:
    """Agg's pixels in a 256-colour palette (a third of the bytes, the same
    look), with `text` as PNG text chunks and nothing that varies run to run."""
    import numpy as np
    from PIL import Image, PngImagePlugin
    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3]
    image = Image.fromarray(pixels).quantize(256, method=Image.Quantize.MEDIANCUT)
    info = PngImagePlugin.PngInfo()
    for key, value in text.items():
        info.add_text(key, value)
    image.save(path, "PNG", pnginfo=info, optimize=True)


def draw(name: str, pictures_dir: Path = PICTURES_DIR) -> Path:
    """Draw one picture from its data files; the PNG stamped with their sha256."""
    names, drawer = PICTURES[name]
    data_dir = pictures_dir / "data"
    fig = drawer([json.loads((data_dir / n).read_text()) for n in names])
    path = pictures_dir / name
    save_png(fig, path, {"Title": name,
                         "Source": " ".join(f"pictures/data/{n}" for n in names),
                         STAMP: data_stamp(names, data_dir)})
    pyplot().close(fig)
    return path


def png_stamp(path: Path) -> str | None:
    from PIL import Image
    with Image.open(path) as image:
        return image.text.get(STAMP)


def stale_pictures(pictures_dir: Path = PICTURES_DIR) -> list[str]:
    """Every picture whose data changed since it was drawn, every picture
    missing, and every PNG in pictures/ that no data file draws."""
    data_dir = pictures_dir / "data"
    problems = []
    for png in sorted(pictures_dir.glob("*.png")):
        if png.name not in PICTURES:
            problems.append(f"pictures/{png.name}: no data file draws it (not in PICTURES)")
    for name, (names, _) in PICTURES.items():
        missing = [n for n in names if not (data_dir / n).exists()]
        if missing:
            problems.append(f"pictures/{name}: its data file is missing: "
                            + ", ".join(f"pictures/data/{n}" for n in missing))
        elif not (pictures_dir / name).exists():
            problems.append(f"pictures/{name}: not drawn (make pictures)")
        elif png_stamp(pictures_dir / name) != data_stamp(names, data_dir):
            problems.append(f"pictures/{name}: its data changed since it was drawn "
                            f"({', '.join(names)}; make pictures)")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--record", action="store_true",
                      help="run the engine and write the data files (make traces)")
    mode.add_argument("--check", action="store_true",
                      help="change nothing: list the pictures whose data changed (exit 1)")
    mode.add_argument("--recording", type=Path, metavar="FILE",
                      help="draw the KV pool over the steps of a live view's recording "
                           "(--record-events FILE) into --out")
    p.add_argument("--out", type=Path, default=Path("kv-pool.png"))
    args = p.parse_args(argv)
    if args.recording:
        print(f"[pictures] {draw_recording(args.recording, args.out)}")
        return 0
    if args.record:
        record()
        return 0
    if args.check:
        problems = stale_pictures()
        print("\n".join(problems) or f"[pictures] {len(PICTURES)} pictures up to date")
        return 1 if problems else 0
    for name in PICTURES:
        print(f"[pictures] {draw(name).relative_to(ROOT)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
