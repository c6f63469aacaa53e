"""What the live view costs the engine: off, on, and with a viewer attached.

    python -m bench.profiles.live_view_cost          # ~5 min on 2 cores
    make bench-live-view

Two measurements, each an A/B in one run, the two sides in turn (ABBA...)
so that a machine that drifts (turbo, a neighbour) cancels out:

1. **The step**: one engine on the embedded model, 32 sequences decoding;
   median step time with the step events off (`engine.step_events` is
   None: the step does no extra work) and on (a frame built every step,
   turned into JSON by the live view's `on_frame`, as `--live-view` does).
2. **Served**: chapter 06's server (chapter 05's engine) with
   `--live-view` under one long load, 32 clients streaming 64-token
   answers (`ignore_eos`); 12-second windows in turn with and without one
   viewer reading /ui/events; the median tok/s of each side's windows,
   from the engine's own token count. The aim is at least 0.97x. (Step 1
   compares the events off and on; separate loads or server starts
   differed here by more than the effect, from one minute to the next.)

Left out: a browser drawing the frames (it runs in its own process; on
the same 2 cores it would take CPU from both sides alike).
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import requests

from bench.record import bf16_words, record_head, write_results
from bench.loadtest import ChapterServer, run_load
from common.entrypoints.live_view import HISTORY
from common.net import free_port

CLIENTS, MAX_TOKENS = 32, 64
WINDOWS, WINDOW_S = 16, 12.0  # served: windows with and without a viewer, in turn
STEP_BLOCKS, STEPS_PER_BLOCK = 16, 12  # engine: blocks of steps, off and on in turn
CARD = "2"  # GiB: 32 requests fit, no preemption
AIM = 0.97


# ------------------------------------------------------------ the step
def step_times(blocks: int = STEP_BLOCKS, steps: int = STEPS_PER_BLOCK) -> dict:
    """Median decode-step time, events off and on in turn, 32 sequences."""
    from common.config import EngineConfig
    from common.engine.parts import assemble_engine
    from common.entrypoints.live_view import LiveView
    from common.sampling_params import SamplingParams
    engine = assemble_engine(EngineConfig(dtype="float32", device="cpu", device_memory_gb=float(CARD)))
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    prompt = engine.tokenizer("Tell me a long story about the sea.")["input_ids"]
    for i in range(CLIENTS):
        engine.add_request(f"r{i}", prompt, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.sequences.values()):
        engine.step()  # the prefills: every sequence decodes from here on
    view = LiveView(engine.describe())
    events = engine.enable_step_events()
    events.subscribe(view.on_frame)
    inside: list[float] = []  # the frame's own time, measured inside the step
    observe_step = events.observe_step

    def timed(*args) -> None:
        start = time.perf_counter()
        observe_step(*args)
        inside.append(time.perf_counter() - start)

    events.observe_step = timed
    times: dict[str, list[float]] = {"off": [], "on": []}
    for block in range(blocks):
        side = ("off", "on", "on", "off")[block % 4]  # ABBA
        engine.step_events = events if side == "on" else None
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times[side].append(time.perf_counter() - start)
    off, on = (statistics.median(times[k]) for k in ("off", "on"))
    return {"seqs": CLIENTS, "steps_each": len(times["off"]), "off_ms": off * 1e3,
            "on_ms": on * 1e3, "on_over_off": on / off,
            "frame_ms": statistics.median(inside) * 1e3}


# ------------------------------------------------------------- served
def watch(url: str, stop: threading.Event, counts: dict) -> None:
    """One viewer: reads /ui/events until told to stop."""
    with requests.get(url + "/ui/events", stream=True, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith(b"event: step"):
                counts["frames"] += 1
            if stop.is_set():
                return


def generated(url: str) -> int:
    return requests.get(url + "/stats", timeout=30).json()["generation_tokens"]


def served(log_dir: Path, windows: int = WINDOWS) -> dict:
    """One server with --live-view under one long load of 32 streaming
    clients; windows of WINDOW_S seconds in turn (ABBA...) with and without
    a viewer reading /ui/events (it joins at the start of its window, its
    history burst included); tok/s of each window from the engine's own
    count of generated tokens (/stats). Paired in time: the machine's drift
    from one minute to the next falls on both sides alike."""
    port = free_port()
    args = ["--dtype", "float32", "--device-memory-gb", CARD, "--live-view"]
    runs = []
    with ChapterServer("06", port, args, log_dir / f"ch06-{port}.log") as server:
        load = threading.Thread(target=run_load, daemon=True, args=(
            server.url, CLIENTS, 10_000, MAX_TOKENS), kwargs={"stream": True,
                                                             "deadline": WINDOW_S * (windows + 2)})
        load.start()
        time.sleep(WINDOW_S)  # every client streaming
        for w in range(windows):
            viewer = (False, True, True, False)[w % 4]  # ABBA
            stop, counts = threading.Event(), {"frames": 0}
            reader = threading.Thread(target=watch, args=(server.url, stop, counts), daemon=True)
            before, start = generated(server.url), time.perf_counter()
            if viewer:
                reader.start()
            time.sleep(WINDOW_S)
            after, seconds = generated(server.url), time.perf_counter() - start
            stop.set()
            if viewer:
                reader.join()
            runs.append({"viewer": viewer, "tokens_per_s": (after - before) / seconds,
                         "frames_read": counts["frames"]})
    off = statistics.median(x["tokens_per_s"] for x in runs if not x["viewer"])
    on = statistics.median(x["tokens_per_s"] for x in runs if x["viewer"])
    return {"runs": runs, "off_tokens_per_s": off, "viewer_tokens_per_s": on,
            "ratio": on / off, "aim": AIM}


# ------------------------------------------------------------ report
def markdown(rec: dict) -> str:
    m, step, srv = rec["machine"], rec["step"], rec["served"]
    lines = ["# The live view's cost", "",
             f"Measured {rec['date']} on {m['cpu']} ({m['cores']} cores, {bf16_words(m)}), "
             f"torch {m['torch']}, float32; {rec['minutes']:.1f} min.",
             f"Command: `{rec['command']}`.", "",
             f"## The step ({step['seqs']} sequences decoding, {step['steps_each']} steps "
             "of each side, in turn)", "",
             "| step events | median step |", "|---|---|",
             f"| off (`engine.step_events` is None) | {step['off_ms']:.1f} ms |",
             f"| on (a frame and its JSON every step) | {step['on_ms']:.1f} ms |", "",
             f"On / off: **{step['on_over_off']:.3f}x**. Timed inside the step, the "
             f"frame itself (the queues, the blocks, the KV events, its JSON) takes "
             f"{step['frame_ms']:.2f} ms: {100 * step['frame_ms'] / step['off_ms']:.1f} % "
             "of the median step with the events off.", "",
             f"## Served: chapter 06, {CLIENTS} clients streaming {MAX_TOKENS}-token answers",
             "", f"`--live-view` on, one server, one load; {WINDOW_S:.0f}-second windows in turn. "
             "A viewer joins at the start of its window: its frames read include the "
             f"history the server sends on connect (up to {HISTORY} frames).",
             "", "| window | viewer | tok/s | frames read |", "|---|---|---|---|"]
    lines += [f"| {i + 1} | {'one viewer' if r['viewer'] else 'none'} | "
              f"{r['tokens_per_s']:.1f} | {r['frames_read']} |"
              for i, r in enumerate(srv["runs"])]
    lines += ["", f"With one viewer / without, medians: {srv['viewer_tokens_per_s']:.1f} / "
              f"{srv['off_tokens_per_s']:.1f} tok/s = **{srv['ratio']:.3f}x** "
              f"(aim: at least {srv['aim']:.2f}x)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    begin = time.perf_counter()
    log_dir = Path("/tmp/live-view-cost")
    log_dir.mkdir(exist_ok=True)
    rec = {**record_head("python -m bench.profiles.live_view_cost"),
           "step": step_times(), "served": served(log_dir)}
    rec["minutes"] = (time.perf_counter() - begin) / 60
    write_results(args.out_dir, "live-view-cost", rec, markdown(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
