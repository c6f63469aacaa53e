"""Measure the answers of exercise 05's "Predict, then measure" (solutions.md).

    flock /tmp/cpu.lock .venv/bin/python 05-continuous-batching/exercises/measure.py

Runs, one after another (about 2 minutes on 2 quiet cores):

1. the README's load tests: 16 clients x 64 tokens on the 0.75 GiB card
   (twice: with prefix caching on, how many requests find the system
   prompt's block cached depends on when each arrives, so the counts may
   differ), the same with `--no-enable-prefix-caching` (the answers before
   chapter 05 turned it on), and on the 1.1 GiB demo card;
2. 16 clients x 32 tokens on the demo card with a token budget of 32
   (`--max-num-batched-tokens 32`), then 512, the default;
3. the engine alone, in-process: all 16 prompts added at once,
   `LLMEngine.step` until done, for budgets 512 and 32, prefix caching on
   (as the servers) and off: steps in all, steps that computed prompt
   tokens, prompt tokens computed, the median time of a step of each kind
   (after a warm-up run).

It first waits (up to `--wait-quiet` seconds) for the load average to fall
below 0.7 (`--quiet-load`): the speeds depend on what else runs on the machine.

Writes `results/measured-DATE.json` beside this file: the machine, and for
each run its command, the server's `KV cache:` line, its step log lines
(`Running: ... Preemptions: N`), the load test's summary and `/stats`.
Each load test starts chapter 05's server on `--port` (8005: its log is
/tmp/loadtest-ch05-8005.log) and stops it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def wait_for_quiet_machine(max_wait_s: float, below: float) -> None:
    """Wait until the 1-minute load average is below `below` (or give up)."""
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] >= below and time.monotonic() < deadline:
        print(f"load average {os.getloadavg()[0]:.2f}: waiting for a quiet machine",
              file=sys.stderr, flush=True)
        time.sleep(10)


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
    return {
        "date": datetime.date.today().isoformat(),
        "cpu": model.group(1).strip() if model else "unknown",
        "cores": os.cpu_count(),
        "bf16_flags": sorted(set(re.findall(r"\b(amx_bf16|avx512_bf16)\b", cpuinfo))),
        "load_average_at_start": list(os.getloadavg()),
    }


def loadtest(args: list[str], port: int) -> dict:
    """One `python -m bench.loadtest --chapter 05 ...` run, with its server log."""
    argv = ["-m", "bench.loadtest", "--chapter", "05", *args, "--port", str(port)]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        started = time.monotonic()
        done = subprocess.run([sys.executable, *argv, "--json", out.name], cwd=ROOT,
                              capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.monotonic() - started
        summary = json.loads(Path(out.name).read_text()) if Path(out.name).stat().st_size else None
    log = Path(f"/tmp/loadtest-ch05-{port}.log").read_text(errors="replace")
    print(done.stdout[-1500:], file=sys.stderr, flush=True)
    return {
        "command": "python " + " ".join(argv),
        "exit_code": done.returncode,
        "wall_s": round(wall, 1),
        "kv_cache_line": next((line[line.index("KV cache:"):] for line in log.splitlines()
                               if "KV cache:" in line), None),
        "step_log_lines": [line[line.index("Avg prompt"):] for line in log.splitlines()
                           if "Avg prompt throughput" in line],
        "summary": summary,
    }


STEPS_COMMAND = "python 05-continuous-batching/exercises/measure.py (steps(), in-process)"


def steps(budget: int, prefix_caching: bool, loaded) -> dict:
    """The engine alone: 16 prompts added at once, step until done."""
    from bench.loadtest import prompt_messages
    from common.config import EngineConfig
    from common.engine.llm_engine import LLMEngine
    from common.loader import apply_chat_template
    from common.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(device_memory_gb=1.1, dtype="float32",
                                    max_num_batched_tokens=budget,
                                    enable_prefix_caching=prefix_caching), loaded=loaded)
    for i in range(16):
        engine.add_request(str(i), apply_chat_template(loaded.tokenizer, prompt_messages(i)),
                           SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    total = prefill_steps = 0
    prefill_ms, decode_ms = [], []  # one step's wall time, by kind
    started = time.monotonic()
    while engine.has_unfinished_requests():
        before = engine.stats.prompt_tokens
        t0 = time.perf_counter()
        engine.step()
        ms = (time.perf_counter() - t0) * 1000
        total += 1
        if engine.stats.prompt_tokens > before:
            prefill_steps += 1
            prefill_ms.append(ms)
        else:
            decode_ms.append(ms)
    snap = engine.snapshot()
    return {"max_num_batched_tokens": budget, "enable_prefix_caching": prefix_caching,
            "steps": total, "steps_with_prompt_tokens": prefill_steps,
            "decode_only_steps": total - prefill_steps,
            "prompt_tokens_computed": snap["prompt_tokens"],
            "prefix_cache_hits_tokens": snap["prefix_cache_hits"],
            "prefix_cache_queries_tokens": snap["prefix_cache_queries"],
            "median_ms_step_with_prompt_tokens": round(statistics.median(prefill_ms), 1),
            "median_ms_decode_only_step": round(statistics.median(decode_ms), 1),
            "wall_s": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8005)
    p.add_argument("--out", type=Path,
                   default=HERE / "results" / f"measured-{datetime.date.today()}.json")
    p.add_argument("--skip-steps", action="store_true", help="only the load tests")
    p.add_argument("--wait-quiet", type=float, default=180.0,
                   help="seconds to wait for a quiet machine first (0: do not wait)")
    p.add_argument("--quiet-load", type=float, default=0.7,
                   help="quiet: a 1-minute load average below this")
    args = p.parse_args(argv)
    wait_for_quiet_machine(args.wait_quiet, args.quiet_load)

    card = ["--dtype", "float32"]
    runs = {
        "card_0.75_64_tokens": ["--clients", "16", "--max-tokens", "64",
                                "--device-memory-gb", "0.75", *card],
        "card_0.75_64_tokens_again": ["--clients", "16", "--max-tokens", "64",
                                      "--device-memory-gb", "0.75", *card],
        "card_0.75_64_tokens_no_prefix_caching": ["--clients", "16", "--max-tokens", "64",
                                                  "--device-memory-gb", "0.75", *card,
                                                  "--no-enable-prefix-caching"],
        "card_1.1_64_tokens": ["--clients", "16", "--max-tokens", "64",
                               "--device-memory-gb", "1.1", *card],
        "budget_32": ["--clients", "16", "--max-tokens", "32", "--device-memory-gb", "1.1",
                      *card, "--max-num-batched-tokens", "32"],
        "budget_512": ["--clients", "16", "--max-tokens", "32", "--device-memory-gb", "1.1",
                       *card],
    }
    record = {"machine": machine(), "runs": {}}
    for name, run_args in runs.items():
        print(f"--- {name}", file=sys.stderr, flush=True)
        record["runs"][name] = loadtest(run_args, args.port)
    if not args.skip_steps:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from common.loader import load_model
        loaded = load_model()
        steps(512, True, loaded)  # a warm-up run: the first forward passes are slow
        record["in_process_steps"] = {
            "command": STEPS_COMMAND,
            "runs": [steps(budget, prefix, loaded)
                     for prefix in (True, False) for budget in (512, 32)],
        }
        print(json.dumps(record["in_process_steps"], indent=1), file=sys.stderr)
    record["machine"]["load_average_at_end"] = list(os.getloadavg())
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
