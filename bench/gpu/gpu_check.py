"""The one-shot GPU check: everything the course says about CUDA, verified
in one run (ch04-06, bench).

    bash bench/gpu_check.sh            # on the GPU machine: wheels, then this
    python -m bench.gpu.gpu_check --out DIR [--budget-s 480]

Four steps, in order; a failing step is recorded and the next one runs, so
one run tells everything:

1. `kernels`: the Triton kernels against the PyTorch reference on CUDA, in
   bfloat16 and float32, several context lengths and GQA ratios, timed
   (bench/gpu/gpu_kernels_check.py).
2. `equivalence`: greedy float32 on CUDA, our engine's tokens equal HF
   `model.generate`'s for a tiny random Llama and a tiny random GPT-2
   (`--load-format dummy`), eager and with CUDA graphs.
3. `demo`: the card capped with `torch.cuda.set_per_process_memory_fraction`
   (`--device-memory-gb 1.1`, float32, the default model's shape with
   dummy weights): the second of two clients of chapter 02 gets CUDA's own
   out-of-memory error, the server stays up, and chapter 05 serves the
   same load on the same card.
4. `bench`: `make bench-gpu` (dummy Llama-1B, bfloat16, 64 and 256 clients,
   chapters 02, 05, 06 and transformers' peers), within what is left of
   the budget.

It writes `gpu-check.json` and `gpu-check.md` in `--out` (the GPU's name,
driver, torch and triton versions, each step's status, figures and log
tail). Without CUDA every step says "skipped: no CUDA device" and the run
still succeeds: that is how CI checks this script.

Left out: multi-GPU, profiling runs (torch profiler traces are too large to
bring back in a short slot).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Step:
    name: str
    status: str = "skipped"  # "ok" | "failed" | "skipped"
    detail: str = ""
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    log_tail: str = ""


def machine() -> dict:
    from common.loader import cpu_model
    info = {"cpu": cpu_model(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "gpu": None, "driver": None, "triton": None}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            pass
    return info


def run_command(step: Step, command: list[str], timeout: float) -> int:
    """Run a command of the repository; keep the end of its output. Out of
    time, it gets Ctrl-C first, so that the servers it started (each in its
    own session) are stopped by its `with` blocks, not left holding the GPU."""
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
        try:
            output, _ = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        step.log_tail = (output or "")[-4000:]
        raise RuntimeError(f"timed out after {timeout:.0f} s") from None
    step.log_tail = output[-4000:]
    return process.returncode


# ------------------------------------------------------------------ steps
def step_kernels(step: Step, budget: float) -> None:
    code = run_command(step, [sys.executable, "bench/gpu/gpu_kernels_check.py"], budget)
    step.status, step.detail = ("ok", "every comparison within tolerance") if code == 0 \
        else ("failed", f"gpu_kernels_check.py exited {code}")


def step_equivalence(step: Step, budget: float) -> None:
    """Our engine vs HF generate, greedy float32 on CUDA, eager and graphed."""
    from common.config import EngineConfig
    from common.engine.parts import assemble_engine
    from common.loader import load_model
    from common.sampling_params import SamplingParams

    prompts = {str(i): [1 + (7 * i + j) % 500 for j in range(5 + 3 * i)] for i in range(4)}
    results, failures = {}, []
    for name in ("tiny-llama", "tiny-gpt2"):
        loaded = load_model(name, dtype="float32", device="cuda", load_format="dummy")
        expected = {}
        for request_id, ids in prompts.items():
            input_ids = torch.tensor([ids], device="cuda")
            out = loaded.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                        max_new_tokens=24, do_sample=False, min_new_tokens=24)
            expected[request_id] = out[0, len(ids):].tolist()
        for eager in (True, False):
            engine = assemble_engine(EngineConfig(model=name, dtype="float32", device="cuda",
                                            load_format="dummy", enforce_eager=eager),
                               loaded=loaded, num_blocks=64)
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            for request_id, ids in prompts.items():
                engine.add_request(request_id, ids, params)
            done = {}
            while engine.has_unfinished_requests():
                done.update({o.request_id: o for o in engine.step() if o.finished})
            same = all(done[r].outputs[0].token_ids == expected[r] for r in prompts)
            label = f"{name} {'eager' if eager else 'cuda graphs'}"
            results[label] = "equal" if same else "DIFFERENT"
            if not same:
                failures.append(label)
    step.figures = results
    step.status = "failed" if failures else "ok"
    step.detail = (f"differs from HF generate: {', '.join(failures)}" if failures
                   else "tokens equal HF generate's, eager and with CUDA graphs")


def step_demo(step: Step, budget: float) -> None:
    from bench.loadtest import ChapterServer, run_load

    logs = Path("/tmp/gpu-check-logs")
    logs.mkdir(exist_ok=True)
    # The default model's shape with random weights: the memory story is the
    # shape's, and its weights are too large to carry to a GPU machine.
    card = ["--device-memory-gb", "1.1", "--dtype", "float32", "--load-format", "dummy"]
    with ChapterServer("02", 8702, card, logs / "ch02.log") as server:
        naive = run_load(server.url, 2, 1, max_tokens=64, timeout=120, deadline=budget / 2)
        alive = server.alive()
        oom_text = server.log_tail(60)
    with ChapterServer("05", 8705, card, logs / "ch05.log") as server:
        engine = run_load(server.url, 2, 1, max_tokens=64, timeout=120, deadline=budget / 2)
    real_cuda_oom = any("CUDA out of memory" in e and "simulated" not in e
                        for e in naive["first_errors"])
    step.figures = {"ch02": f"{naive['completed']} done / {naive['failed']} failed",
                    "ch02 first error": (naive["first_errors"] or ["-"])[0][:300],
                    "ch02 alive after": alive,
                    "ch05": f"{engine['completed']} done / {engine['failed']} failed"}
    ok = (naive["completed"] == 1 and naive["failed"] == 1 and real_cuda_oom and alive
          and engine["failed"] == 0)
    step.status = "ok" if ok else "failed"
    step.detail = ("chapter 02: one success, one real CUDA OOM, still up; chapter 05: all "
                   "served" if ok else "see figures")
    step.log_tail = oom_text[-2000:]


def step_bench(step: Step, budget: float, out: Path, extra: list[str]) -> None:
    code = run_command(step, [sys.executable, "-m", "bench.bench", "--preset", "gpu",
                              "--out-dir", str(out), *extra], budget)
    tables = sorted((out / "results").glob("*-gpu.md"))
    if tables:
        step.figures = {"table": tables[-1].read_text()[-3000:]}
    step.status = "ok" if code == 0 else "failed"
    step.detail = "make bench-gpu finished" if code == 0 else f"bench exited {code}"


def missing_server_packages() -> list[str]:
    """The web stack's packages that do not import, each with the reason."""
    missing = []
    for name in ("fastapi", "uvicorn", "requests", "matplotlib", "ahocorasick", "jsonschema"):
        try:
            __import__(name)
        except ImportError as exc:
            missing.append(f"{name} ({exc})")
    return missing


# ------------------------------------------------------------------- main
STEP_NAMES = ("kernels", "equivalence", "demo", "bench")


def run_steps(out: Path, budget_s: float, only: tuple[str, ...] = STEP_NAMES,
              bench_args: list[str] | None = None) -> list[Step]:
    start = time.monotonic()

    def left() -> float:
        return budget_s - (time.monotonic() - start)

    plan: list[tuple[str, Callable[[Step, float], None], float]] = [
        ("kernels", step_kernels, 0.2),
        ("equivalence", step_equivalence, 0.15),
        ("demo", step_demo, 0.25),
        ("bench", lambda s, b: step_bench(s, b, out, bench_args or []), 1.0),
    ]
    plan = [entry for entry in plan if entry[0] in only]
    steps = []
    for name, function, share in plan:
        step = Step(name)
        steps.append(step)
        if not torch.cuda.is_available():
            step.detail = "skipped: no CUDA device"
            continue
        missing = missing_server_packages() if name in ("demo", "bench") else []
        if missing:
            step.detail = f"skipped: {'; '.join(missing)} does not import (see gpu_check.sh)"
            continue
        if left() < 20:
            step.detail = "skipped: out of time"
            continue
        began = time.monotonic()
        try:
            function(step, left() * share if share < 1 else left() - 10)
        except Exception as exc:  # noqa: BLE001 - record it, go on to the next step
            step.status, step.detail = "failed", f"{type(exc).__name__}: {exc}"
            step.log_tail = (step.log_tail + "\n" + traceback.format_exc())[-4000:]
        step.seconds = round(time.monotonic() - began, 1)
        print(f"[gpu-check] {name}: {step.status} ({step.seconds} s) {step.detail}",
              flush=True)
    return steps


def render(record: dict) -> str:
    m = record["machine"]
    lines = [f"# GPU check, {record['date']}", "",
             f"GPU {m['gpu'] or 'none'} (driver {m['driver'] or '-'}), "
             f"CPU {m.get('cpu') or 'not recorded'}, CUDA {m['cuda']}, "
             f"torch {m['torch']}, triton {m['triton']}, Python {m['python']}.",
             f"Command: `{record['command']}`", "",
             "| step | status | seconds | detail |", "|---|---|---|---|"]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']} | "
              f"{s['detail'].splitlines()[0] if s['detail'] else ''} |" for s in record["steps"]]
    for s in record["steps"]:
        if s["figures"]:
            lines += ["", f"## {s['name']}", ""]
            lines += [f"- {k}: {v}" if k != "table" else f"\n{v}" for k, v in s["figures"].items()]
        if s["name"] == "kernels" and s["status"] == "ok":
            lines += ["", "## kernels", "", "```", s["log_tail"].strip(), "```"]
        elif s["status"] == "failed":
            lines += ["", f"## {s['name']}: why it failed", "", "```",
                      s["detail"].strip()[-1500:], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results",
                        help="where gpu-check.json and gpu-check.md go")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="the whole run's time, seconds (default 8 minutes)")
    parser.add_argument("--steps", nargs="+", choices=STEP_NAMES, default=list(STEP_NAMES),
                        help="run only these steps (a rerun of the ones that failed)")
    parser.add_argument("--bench-args", default="",
                        help="more flags for the bench step, e.g. \"--chapters 05 06 --clients 64\"")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(["python -m bench.gpu.gpu_check", *(argv or sys.argv[1:])]),
              "machine": machine(),
              "steps": [asdict(s) for s in run_steps(args.out, args.budget_s, tuple(args.steps),
                                                        args.bench_args.split())]}
    (args.out / "gpu-check.json").write_text(json.dumps(record, indent=2))
    (args.out / "gpu-check.md").write_text(render(record))
    print(render(record))
    return 1 if any(s["status"] == "failed" for s in record["steps"]) else 0


if __name__ == "__main__":
    sys.exit(main())
