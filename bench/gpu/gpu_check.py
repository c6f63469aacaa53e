"""The GPU check: what the course says about CUDA, in five steps that each
fit a short slot of GPU time (ch02-ch05, bench).

    bash bench/gpu_check.sh                       # on the GPU machine: wheels, then this
    python -m bench.gpu.gpu_check [--out DIR] [--steps demo graphs] [--rehearse]

The steps, in priority order. Each runs in a process of its own, stopped
(Ctrl-C first, so that its servers are stopped too) at `--step-limit-s`
(170 s), and each writes its own results file as it finishes
(`DATE-gpu-check-NN-step.md` and `.json` in `--out`, bench/results by
default), so that a run cut off keeps what it finished;
`DATE-gpu-check.md` sums the steps up after each one:

1. `demo`: the instructor's demo. The card capped at 1.1 GiB
   (`--device-memory-gb`, float32, the default model's shape): two
   clients of chapter 02, the second gets CUDA's own out-of-memory error
   and the server stays up; then 32 clients of chapter 05 on the same cap,
   none failing.
2. `correctness`: the Triton kernels against the PyTorch reference
   (bench/gpu/gpu_kernels_check.py, timed) and greedy float32 equality
   with HF `model.generate` for a tiny random Llama and GPT-2, eager and
   with CUDA graphs.
3. `throughput`: chapter 02 against chapter 05 against HF `generate` with
   static batches, on the whole GPU (Llama-3.2-1B's shape, bfloat16,
   random weights), tokens per second and their ratios: the seed's "up to
   24 times the naive method" measured on the course's own engine.
4. `graphs`: chapter 05's engine with CUDA graphs against `--enforce-eager`
   on the same load, in one process.
5. `decode-kernel`: the grouped-query decode kernel against the
   reference, with and without split-K, at SmolLM2's and Llama-3-8B's
   shapes (`gpu_kernels_check.py --decode-only`).

Without CUDA every step says "skipped: no CUDA device" and the run still
succeeds: that is how CI checks this script. `--rehearse`, on a machine
without CUDA, runs the steps that can run on the CPU at a small size
instead (the demo on the simulated card, greedy equality, the throughput
ladder and the graphs' load with the tiny Llama, both rows eager), so that
their code has run before a GPU is lent; the decode kernel's timing says
it needs CUDA.

Left out: multi-GPU, profiler traces (too large to bring back from a short
slot), and the default model's trained weights: its GGUF (98 MB) is more
than a device run can carry, so the GPU loads its shape with random
weights (`--load-format dummy`), which is all the memory story needs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from bench import record
from bench.record import bf16_words

ROOT = Path(__file__).resolve().parents[2]
STEP_LIMIT_S = 170.0  # each step's time, under 3 minutes
LOGS = Path("/tmp/gpu-check-logs")


@dataclass
class Step:
    name: str
    status: str = "skipped"  # "ok" | "failed" | "skipped"
    detail: str = ""
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)  # name -> value; a "table" is Markdown
    log_tail: str = ""


@dataclass(frozen=True)
class Setup:
    """Where a step runs: on CUDA, or rehearsed on the CPU at a small size."""
    device: str  # "cuda" | "cpu"
    limit_s: float

    @property
    def rehearsal(self) -> bool:
        return self.device != "cuda"


def machine() -> dict:
    """bench/record.py's machine (CPU, its bf16 support, GPU, versions), with
    CUDA's version, the GPU's driver and Triton's version."""
    info = {**record.machine(), "cuda": torch.version.cuda, "driver": None, "triton": None}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            pass
    return info


def run_command(command: list[str], timeout: float) -> tuple[int | None, str]:
    """Run a command of the repository; (exit code, its output). Out of time,
    it gets Ctrl-C first, so that the servers it started are stopped by its
    `with` blocks, not left holding the GPU; the code is then None."""
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=max(1.0, timeout))
        return process.returncode, output
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        return None, output or ""


# ------------------------------------------------------------------ steps
def step_demo(step: Step, setup: Setup) -> None:
    """Chapter 02 crashes on the capped card with two clients; chapter 05
    serves 32 on the same card."""
    from bench.loadtest import ChapterServer, run_load

    # The default model's shape with random weights: the memory story is the
    # shape's, and its weights are too large to carry to a GPU machine.
    card = ["--device-memory-gb", "1.1", "--dtype", "float32", "--load-format", "dummy",
            "--device", setup.device]
    deadline = setup.limit_s / 3
    with ChapterServer("02", 8702, card, LOGS / "demo-ch02.log") as server:
        naive = run_load(server.url, 2, 1, max_tokens=64, timeout=deadline, deadline=deadline)
        alive = server.alive()
        # the server's own lines, without the traceback's frames
        oom_log = [line for line in server.log_tail(300).splitlines()
                   if line.strip() and not line.startswith((" ", "Traceback"))]
    with ChapterServer("05", 8705, card, LOGS / "demo-ch05.log") as server:
        engine = run_load(server.url, 32, 1, max_tokens=64, timeout=deadline, deadline=deadline)
    # CUDA's own error on a GPU; the simulated card's (which says so) in a rehearsal
    saw_oom = any("CUDA out of memory" in error and ("simulated" in error) == setup.rehearsal
                  for error in naive["first_errors"])
    step.figures = {
        "chapter 02, 2 clients": f"{naive['completed']} done / {naive['failed']} failed",
        "chapter 02's error": (naive["first_errors"] or ["-"])[0][:400],
        "chapter 02 up after it": alive,
        "chapter 05, 32 clients": f"{engine['completed']} done / {engine['failed']} failed",
        "chapter 05 tok/s": round(engine["output_tokens_per_s"], 1)}
    ok = naive["completed"] == 1 and naive["failed"] == 1 and saw_oom and alive \
        and engine["completed"] == 32
    step.status = "ok" if ok else "failed"
    step.detail = ("chapter 02: one answer, one CUDA out-of-memory error, still up; "
                   "chapter 05: 32/32" if ok else "see the figures")
    step.log_tail = "\n".join(oom_log[-25:])


def step_correctness(step: Step, setup: Setup) -> None:
    """The kernels against the reference, then greedy equality with HF."""
    failures = []
    if setup.rehearsal:
        step.figures["kernels"] = ("skipped: needs CUDA (the Triton interpreter's tests cover "
                                   "them on the CPU: tests/test_triton_kernels.py)")
    else:
        code, output = run_command([sys.executable, "bench/gpu/gpu_kernels_check.py"],
                                   setup.limit_s * 0.6)
        step.figures["table"] = "```\n" + output.strip()[-4000:] + "\n```"  # the kernels'
        step.figures["kernels"] = "within tolerance" if code == 0 else "FAILED"
        if code != 0:
            how = "timed out" if code is None else f"exited {code}"
            failures.append(f"gpu_kernels_check.py {how}")
    for label, same in greedy_equality(setup.device).items():
        step.figures[label] = "equal" if same else "DIFFERENT"
        if not same:
            failures.append(f"{label} differs from HF generate")
    step.status = "failed" if failures else "ok"
    if failures:
        step.detail = "; ".join(failures)
    elif setup.rehearsal:
        step.detail = "greedy tokens equal HF generate's (eager: the CPU has no CUDA graphs)"
    else:
        step.detail = ("kernels within tolerance; greedy tokens equal HF generate's, "
                       "eager and with CUDA graphs")


def greedy_equality(device: str) -> dict[str, bool]:
    """Our engine's greedy float32 tokens == HF generate's, per model and mode."""
    from common.config import EngineConfig
    from common.engine.parts import assemble_engine
    from common.loader import load_model
    from common.sampling_params import SamplingParams

    prompts = {str(i): [1 + (7 * i + j) % 500 for j in range(5 + 3 * i)] for i in range(4)}
    modes = (True, False) if device == "cuda" else (True,)  # eager; CUDA graphs
    results = {}
    for name in ("tiny-llama", "tiny-gpt2"):
        loaded = load_model(name, dtype="float32", device=device, load_format="dummy")
        expected = {}
        for request_id, ids in prompts.items():
            input_ids = torch.tensor([ids], device=device)
            out = loaded.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                        max_new_tokens=24, do_sample=False, min_new_tokens=24)
            expected[request_id] = out[0, len(ids):].tolist()
        for eager in modes:
            engine = assemble_engine(EngineConfig(model=name, dtype="float32", device=device,
                                                  load_format="dummy", enforce_eager=eager),
                                     loaded=loaded, num_blocks=64)
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            done = run_engine(engine, prompts, params)
            label = f"{name} {'eager' if eager else 'cuda graphs'}"
            results[label] = all(done[r] == expected[r] for r in prompts)
    return results


def run_engine(engine, prompts: dict[str, list[int]], params) -> dict[str, list[int]]:
    """Every prompt through the engine; request id -> its generated tokens."""
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return done


@dataclass(frozen=True)
class Load:
    """The model and load of the throughput and graphs steps (random weights)."""
    model: str
    dtype: str
    clients: int  # one request each
    max_tokens: int

    @property
    def server_flags(self) -> list[str]:
        return ["--model", self.model, "--load-format", "dummy", "--dtype", self.dtype]


def throughput_load(setup: Setup) -> Load:
    """Llama-3.2-1B's shape in bfloat16 on the GPU, the tiny Llama in a CPU
    rehearsal."""
    return Load("tiny-llama", "float32", 4, 8) if setup.rehearsal else \
        Load("llama-1b", "bfloat16", 32, 64)


def step_throughput(step: Step, setup: Setup) -> None:
    """Chapter 02, chapter 05 and HF's static batches on the same load."""
    from bench.loadtest import ChapterServer, run_load
    from bench.peers.hf_peers import run_peer
    from common.loader import load_model

    load = throughput_load(setup)
    deadline = setup.limit_s / 4
    runs = {}
    for chapter, port in (("02", 8712), ("05", 8715)):
        with ChapterServer(chapter, port, [*load.server_flags, "--device", setup.device],
                           LOGS / f"throughput-ch{chapter}.log") as server:
            runs[f"chapter {chapter}"] = run_load(server.url, load.clients, 1,
                                                  max_tokens=load.max_tokens,
                                                  timeout=deadline, deadline=deadline)
    loaded = load_model(load.model, dtype=load.dtype, device=setup.device, load_format="dummy")
    run_peer("hf-static-batch", loaded, 1, 1, 2)  # warm-up: CUDA's first kernels
    runs["HF generate, static batch"] = run_peer("hf-static-batch", loaded, load.clients, 1,
                                                 load.max_tokens, deadline=deadline)
    hf = runs["HF generate, static batch"]["output_tokens_per_s"]
    naive = runs["chapter 02"]["output_tokens_per_s"]
    lines = [f"{load.clients} clients x 1 request x {load.max_tokens} tokens, {load.model}, "
             f"{load.dtype}", "",
             "| system | done / failed | tok/s | vs HF static batch | vs chapter 02 |",
             "|---|---|---|---|---|"]
    for name, run in runs.items():
        rate = run["output_tokens_per_s"]
        lines.append(f"| {name} | {run['completed']} / {run['failed']} | {rate:.1f} | "
                     f"{ratio(rate, hf)} | {ratio(rate, naive)} |")
    step.figures["table"] = "\n".join(lines)
    failed = {name: run["failed"] for name, run in runs.items() if run["failed"]}
    step.status = "failed" if runs["chapter 05"]["failed"] else "ok"
    step.detail = (f"chapter 05: {ratio(runs['chapter 05']['output_tokens_per_s'], naive)} "
                   f"chapter 02's tok/s, {ratio(runs['chapter 05']['output_tokens_per_s'], hf)} "
                   f"HF static batch's" + (f"; failures: {failed}" if failed else ""))


def ratio(value: float, baseline: float) -> str:
    return f"{value / baseline:.2f}x" if baseline > 0 else "-"


def step_graphs(step: Step, setup: Setup) -> None:
    """The same load through chapter 05's engine, eager then with CUDA graphs."""
    from common.config import EngineConfig
    from common.engine.parts import assemble_engine
    from common.loader import load_model
    from common.sampling_params import SamplingParams

    load = throughput_load(setup)
    loaded = load_model(load.model, dtype=load.dtype, device=setup.device, load_format="dummy")
    prompts = {str(i): [1 + (11 * i + j) % 1000 for j in range(32 + i)]
               for i in range(load.clients)}
    params = SamplingParams(temperature=0, max_tokens=2 * load.max_tokens, ignore_eos=True)
    rates, outputs = {}, {}
    for eager in (True, False):
        engine = assemble_engine(EngineConfig(model=load.model, dtype=load.dtype,
                                              device=setup.device, load_format="dummy",
                                              enforce_eager=eager),
                                 loaded=loaded, num_blocks=1024)
        run_engine(engine, {"warm-up": [1, 2, 3]}, SamplingParams(max_tokens=4))
        start = time.perf_counter()
        outputs[eager] = run_engine(engine, prompts, params)
        if not setup.rehearsal:
            torch.cuda.synchronize()
        rates[eager] = load.clients * params.max_tokens / (time.perf_counter() - start)
        del engine
        torch.cuda.empty_cache()
    same = sum(outputs[True][r] == outputs[False][r] for r in prompts)
    step.figures = {"load": f"{load.clients} requests x {params.max_tokens} tokens, "
                            f"{load.model}, {load.dtype}",
                    "eager tok/s": round(rates[True], 1),
                    "CUDA graphs tok/s": round(rates[False], 1),
                    "graphs / eager": ratio(rates[False], rates[True]),
                    "requests with the same tokens": f"{same}/{load.clients}"}
    step.status = "ok"
    step.detail = f"CUDA graphs: {ratio(rates[False], rates[True])} eager's tok/s" + (
        " (a rehearsal: the CPU runs both eager, the ratio is noise)" if setup.rehearsal else "")


def step_decode_kernel(step: Step, setup: Setup) -> None:
    code, output = run_command([sys.executable, "bench/gpu/gpu_kernels_check.py",
                                "--decode-only"], setup.limit_s - 10)
    step.figures["table"] = "```\n" + output.strip()[-3000:] + "\n```"
    step.status = "ok" if code == 0 else "failed"
    step.detail = ("the decode kernel within tolerance, timed" if code == 0 else
                   "timed out" if code is None else f"gpu_kernels_check.py exited {code}")


# Priority order: a run cut off keeps the first ones.
STEPS: dict[str, Callable[[Step, Setup], None]] = {
    "demo": step_demo,
    "correctness": step_correctness,
    "throughput": step_throughput,
    "graphs": step_graphs,
    "decode-kernel": step_decode_kernel,
}
REHEARSED_ON_CPU = ("demo", "correctness", "throughput", "graphs")
SERVER_STEPS = ("demo", "throughput")  # need the web stack (fastapi, uvicorn, ...)


def missing_server_packages() -> list[str]:
    """The web stack's packages that do not import, each with the reason."""
    missing = []
    for name in ("fastapi", "uvicorn", "requests", "matplotlib", "ahocorasick", "jsonschema"):
        try:
            __import__(name)
        except ImportError as exc:
            missing.append(f"{name} ({exc})")
    return missing


# ------------------------------------------------------------ the files
# NAME.md sums the run up, NAME-NN-step.md is one step's (NAME: DATE-gpu-check
# by default); each has its .json, from which `render` writes the markdown
# again (pictures/make/figures.py checks that they agree).
def step_path(out: Path, name: str, step: str) -> Path:
    return out / f"{name}-{list(STEPS).index(step) + 1:02d}-{step}.json"


def write_step(out: Path, name: str, step: Step, info: dict) -> None:
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": f"python -m bench.gpu.gpu_check --run-step {step.name}",
              "machine": info, "step": asdict(step)}
    path = step_path(out, name, step.name)
    path.write_text(json.dumps(record, indent=2))
    path.with_suffix(".md").write_text(render(record))


def write_summary(out: Path, name: str, steps: list[Step], info: dict, command: str) -> None:
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": command, "machine": info, "steps": [asdict(s) for s in steps]}
    (out / f"{name}.json").write_text(json.dumps(record, indent=2))
    (out / f"{name}.md").write_text(render(record))


def render(record: dict) -> str:
    """The markdown of a step's record, or of a whole run's."""
    m = record["machine"]
    bf16 = f", {bf16_words(m)}" if "cpu_bf16" in m else ""  # not recorded before 2026-12-07
    head = [f"GPU {m['gpu'] or 'none'} (driver {m['driver'] or '-'}), "
            f"CPU {m.get('cpu') or 'not recorded'}{bf16}, CUDA {m['cuda']}, "
            f"torch {m['torch']}, triton {m['triton']}, Python {m['python']}."]
    if "step" in record:
        s = record["step"]
        lines = [f"# GPU check, step {s['name']}: {s['status']} ({s['seconds']} s), "
                 f"{record['date']}", "", *head, "", s["detail"], ""]
        lines += step_sections(s, heading=False)
        return "\n".join(lines) + "\n"
    lines = [f"# GPU check, {record['date']}", "", *head,
             f"Command: `{record['command']}`", "",
             "| step | status | seconds | detail |", "|---|---|---|---|"]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']} | "
              f"{s['detail'].splitlines()[0] if s['detail'] else ''} |" for s in record["steps"]]
    for s in record["steps"]:
        lines += step_sections(s, heading=True)
    return "\n".join(lines) + "\n"


def step_sections(s: dict, heading: bool) -> list[str]:
    """A step's figures, and why it failed (or, for the demo, the server's log)."""
    lines = []
    if s["figures"]:
        lines += ["", f"## {s['name']}", ""] if heading else []
        lines += [f"- {k}: {v}" if k != "table" else f"\n{v}" for k, v in s["figures"].items()]
    if s["name"] == "kernels" and s["status"] == "ok":  # the first run's step (2026-12-04)
        lines += ["", "## kernels", "", "```", s["log_tail"].strip(), "```"]
    elif s["status"] == "failed":
        lines += ["", f"## {s['name']}: why it failed", "", "```",
                  s["detail"].strip()[-1500:], "```"]
        if not heading and s["log_tail"]:
            lines += ["", "```", s["log_tail"].strip()[-3000:], "```"]
    elif s["name"] == "demo" and not heading and s["log_tail"]:
        lines += ["", "## chapter 02's log", "", "```", s["log_tail"].strip(), "```"]
    return lines


# ------------------------------------------------------------------- main
def skip_reason(name: str, rehearse: bool) -> str | None:
    if not torch.cuda.is_available() and not (rehearse and name in REHEARSED_ON_CPU):
        return "skipped: no CUDA device" + (" (needs CUDA, not rehearsed)" if rehearse else "")
    missing = missing_server_packages() if name in SERVER_STEPS else []
    if missing:
        return f"skipped: {'; '.join(missing)} does not import (see gpu_check.sh)"
    return None


def run_one_step(step_name: str, out: Path, run_name: str, limit_s: float) -> int:
    """In the step's own process: run it, write its files."""
    setup = Setup("cuda" if torch.cuda.is_available() else "cpu", limit_s)
    LOGS.mkdir(exist_ok=True)
    step, began = Step(step_name), time.monotonic()
    try:
        STEPS[step_name](step, setup)
    except Exception as exc:  # noqa: BLE001 - record it; the next step still runs
        step.status, step.detail = "failed", f"{type(exc).__name__}: {exc}"
        step.log_tail = (step.log_tail + "\n" + traceback.format_exc())[-4000:]
    step.seconds = round(time.monotonic() - began, 1)
    write_step(out, run_name, step, machine())
    return 0


def run_steps(out: Path, run_name: str, names: list[str], limit_s: float, rehearse: bool,
              command: str) -> list[Step]:
    info, steps = machine(), []
    for step_name in STEPS:  # priority order, whatever order --steps names them in
        if step_name not in names:
            continue
        step = Step(step_name)
        reason = skip_reason(step_name, rehearse)
        if reason:
            step.detail = reason
            write_step(out, run_name, step, info)
        else:
            step = run_in_own_process(step_name, out, run_name, limit_s, info)
        steps.append(step)
        print(f"[gpu-check] {step_name}: {step.status} ({step.seconds} s) {step.detail}",
              flush=True)
        write_summary(out, run_name, steps, info, command)
    return steps


def run_in_own_process(step_name: str, out: Path, run_name: str, limit_s: float,
                       info: dict) -> Step:
    """The step in a child process, stopped at its limit; its file, or one
    saying why there is none."""
    results = step_path(out, run_name, step_name)
    results.unlink(missing_ok=True)
    began = time.monotonic()
    code, output = run_command([sys.executable, "-m", "bench.gpu.gpu_check", "--out", str(out),
                                "--name", run_name, "--run-step", step_name,
                                "--step-limit-s", str(limit_s)], limit_s + 20)
    if results.exists():
        return Step(**json.loads(results.read_text())["step"])
    step = Step(step_name, "failed", f"timed out after {limit_s + 20:.0f} s" if code is None
                else f"the step's process exited {code} without its results",
                round(time.monotonic() - began, 1), log_tail=output[-4000:])
    write_step(out, run_name, step, info)
    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results",
                        help="where the files go (default bench/results)")
    parser.add_argument("--name", default=f"{datetime.date.today()}-gpu-check",
                        help="the files' names: NAME.md, NAME-01-demo.md ... "
                             "(default DATE-gpu-check)")
    parser.add_argument("--steps", nargs="+", choices=list(STEPS), default=list(STEPS),
                        help="run only these steps (a rerun of the ones that failed)")
    parser.add_argument("--step-limit-s", type=float, default=STEP_LIMIT_S,
                        help="each step's time, seconds")
    parser.add_argument("--rehearse", action="store_true",
                        help="without CUDA, run the steps the CPU can run, small")
    parser.add_argument("--run-step", choices=list(STEPS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run_step:
        return run_one_step(args.run_step, args.out, args.name, args.step_limit_s)
    command = " ".join(["python -m bench.gpu.gpu_check", *(argv or sys.argv[1:])])
    steps = run_steps(args.out, args.name, args.steps, args.step_limit_s, args.rehearse, command)
    print((args.out / f"{args.name}.md").read_text())
    return 1 if any(s.status == "failed" for s in steps) else 0


if __name__ == "__main__":
    sys.exit(main())
