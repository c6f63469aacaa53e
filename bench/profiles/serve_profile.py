"""Where a served step's time goes (ch06): the engine thread and the event loop, sampled together.

    python -m bench.profiles.serve_profile                 # 32 and 64 streams, float32 (~3 min)
    python -m bench.profiles.serve_profile --clients 64 --dtype bfloat16

Chapter 06's server runs its engine on a thread of the API server's
process (`AsyncLLM`'s "engine-loop"); the event loop on the main thread
answers HTTP and writes every streamed chunk. Both hold Python's GIL
while they run Python, on a machine of 2 cores. This starts the server,
loads it with N streaming chat clients (the load test's prompts,
bench/loadtest.py), and once the load is steady samples both threads
with py-spy (`py-spy record --threads --idle --format raw`, 100 times a
second, the process not paused) for `--seconds`. Each sample of each
thread goes to one part, by the first frame from the top of its stack
that a rule of `PARTS` names:

- the engine thread: the model's forward pass, sampling, scheduling,
  preparing the inputs, output processing (detokenizing apart), handing
  outputs to the event loop, waiting for work;
- the main thread: the HTTP and SSE work of the event loop, tokenizing
  the prompts, waiting in `select` (idle).

"busy" is a thread's samples outside waiting. Where both threads are busy
at once, one of them waits for the GIL or a core: the two columns add up
to more than 100 % of one core only as far as the other core is free.

vLLM's answer to the same contention: its engine core runs in its own
process (chapter 09's `--engine-core process`), and its async scheduling
overlaps the CPU work of step N+1 with the forward pass of step N.

Results: bench/results/DATE-HOST-serve-profile.{json,md}.

Left out: native frames (`--native`: the torch kernels by name; the
parts here need only the Python frame that called them), the vLLM side
(its processes' stacks are its own).
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.loadtest import ChapterServer, run_for_duration, send_one
from bench.record import bf16_words, record_head, write_results
from common.net import free_port

# (part, a frame's function or file that puts a sample in it), the first
# match from the top of the stack wins: the most specific rules first.
PARTS = [
    ("detokenizing", r"detokenizer\.py"),
    ("output processing", r"output_processor\.py"),
    ("sampling", r"layers/sampler\.py|logits\.py|rejection_sampler\.py"),
    ("scheduling", r"core/scheduler\.py|block_manager\.py"),
    ("preparing the inputs", r"prepare_inputs|input_batch"),
    ("forward pass", r"common/models/|common/layers/|model_runner\.py"),
    ("handing outputs to the event loop", r"_deliver|call_soon_threadsafe"),
    ("waiting for work", r"Event\.wait|Condition\.wait"),
    ("tokenizing prompts", r"tokenizer|apply_chat_template|tokenization"),
    ("idle in select", r"\.select \(.*selectors\.py"),
    ("HTTP and streaming",
     r"uvicorn|starlette|fastapi|h11|asyncio|common/entrypoints|pydantic|json"),
]
IDLE = {"waiting for work", "idle in select"}
THREAD_NAMES = {"engine-loop": "engine", "MainThread": "main"}  # AsyncLLM's, Python's


def sample_threads(lines: list[str]) -> dict[str, collections.Counter]:
    """py-spy's raw lines ("thread (TID): NAME;frame;...;frame COUNT", the
    root first) -> per thread, the samples of each part ("other": no rule).
    The threads are named as the server names them: "engine-loop" is the
    engine's, "MainThread" the event loop's."""
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        threads[THREAD_NAMES.get(thread.rpartition(": ")[2], thread)][part_of(frames)] += int(count)
    return threads


def part_of(frames: list[str]) -> str:
    for frame in reversed(frames):  # from the top of the stack down
        for part, pattern in PARTS:
            if re.search(pattern, frame):
                return part
    return "other"


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy is not installed: `pip install py-spy` (requirements.txt has it)")
    return found


def profile_server(pid: int, seconds: float) -> list[str]:
    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        subprocess.run([py_spy(), "record", "--pid", str(pid), "--duration", str(int(seconds)),
                        "--rate", "100", "--format", "raw", "--threads", "--idle",
                        "--nonblocking", "--full-filenames", "--output", out.name],
                       check=True, capture_output=True)
        return Path(out.name).read_text().splitlines()


def one_load(dtype: str, clients: int, seconds: float, card_gb: float, log: Path) -> dict:
    args = ["smollm2", "--dtype", dtype, "--max-num-seqs", "64",
            "--max-num-batched-tokens", "512", "--device-memory-gb", str(card_gb)]
    with ChapterServer("06", free_port(), args, log) as server:
        send_one(server.url, 0, 2, False, 60, None)  # warm-up, not counted
        warm = 5.0
        summary: dict = {}

        def load() -> None:
            summary.update(run_for_duration(
                lambda c, i: send_one(server.url, c * 1000 + i, 64, True, 300, None),
                clients, warm + seconds + 2))

        loader = threading.Thread(target=load)
        loader.start()
        time.sleep(warm)
        lines = profile_server(server.process.pid, seconds)
        loader.join()
    return {"dtype": dtype, "clients": clients, "seconds": seconds,
            "tok_s": summary.get("output_tokens_per_s"),
            "threads": {t: dict(c) for t, c in sample_threads(lines).items()}}


def markdown(rec: dict) -> str:
    m = rec["machine"]
    lines = ["# Where a served step's time goes: the engine thread and the event loop", "",
             f"Measured {rec['date']} on {m['cpu']} ({m['cores']} cores, {bf16_words(m)}); "
             f"{rec['minutes']:.1f} min.",
             f"Command: `{rec['command']}`. Chapter 06's server (engine on a thread), "
             "streaming chat clients of the load test, 64 tokens each, sent for the whole "
             "run; py-spy at 100 samples a second on both threads. Each cell: % of the "
             "thread's samples (of wall time).", ""]
    for run in rec["runs"]:
        engine = run["threads"].get("engine", {})
        main = run["threads"].get("main", {})
        lines += [f"## {run['dtype']}, {run['clients']} streams "
                  f"({run['tok_s']:.0f} output tok/s while sampled)", "",
                  "| part | engine thread % | main thread (event loop) % |", "|---|---|---|"]
        totals = sum(engine.values()) or 1, sum(main.values()) or 1
        parts = [p for p, _ in PARTS] + ["other"]
        for part in parts:
            e, h = engine.get(part, 0) / totals[0], main.get(part, 0) / totals[1]
            if e or h:
                lines.append(f"| {part} | {100 * e:.1f} | {100 * h:.1f} |")
        busy = [100 * (1 - sum(c.get(p, 0) for p in IDLE) / t)
                for c, t in ((engine, totals[0]), (main, totals[1]))]
        lines += [f"| **busy** | **{busy[0]:.1f}** | **{busy[1]:.1f}** |", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", nargs="+", type=int, default=[32, 64])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seconds", type=float, default=20.0, help="sampled, per load")
    p.add_argument("--card", type=float, default=1.85, help="GiB (vLLM's 1 GiB of KV cache)")
    p.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    begin = time.perf_counter()
    log_dir = Path(tempfile.mkdtemp(prefix="serve-profile-"))
    runs = [one_load(args.dtype, clients, args.seconds, args.card,
                     log_dir / f"ch06-{clients}.log") for clients in args.clients]
    command = "python -m bench.profiles.serve_profile " + " ".join(argv or sys.argv[1:])
    rec = {**record_head(command.strip()), "runs": runs,
           "minutes": (time.perf_counter() - begin) / 60}
    write_results(args.out_dir, f"serve-profile-{args.dtype}", rec, markdown(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
