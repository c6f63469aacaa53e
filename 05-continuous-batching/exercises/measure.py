"""Measure the answers of exercise 05's "Predict, then measure" (solutions.md).

    flock /tmp/cpu.lock .venv/bin/python 05-continuous-batching/exercises/measure.py

Runs, one after another (about 3 minutes on 2 quiet cores):

1. the README's load tests: 16 clients x 64 tokens on the 0.75 GiB card,
   three times (`--repeats`: with prefix caching on, how many requests
   find the system prompt's block cached depends on when each arrives,
   so the counts differ from run to run), once with
   `--no-enable-prefix-caching` (the answers before chapter 05 turned it
   on), and once on the 1.1 GiB demo card;
2. 16 clients x 32 tokens on the demo card with a token budget of 32
   (`--max-num-batched-tokens 32`) and 512, the default, in turn, three
   times each; their medians in `budget_medians`;
3. the engine alone, in-process: all 16 prompts added at once,
   `LLMEngine.step` until done, for budgets 512 and 32, prefix caching on
   (as the servers) and off: steps in all, steps that computed prompt
   tokens, prompt tokens computed, the median time of a step of each kind
   and every step's tokens and time (after a warm-up run).

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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import (  # noqa: E402
    add_wait_quiet_args,
    measurement_machine,
    wait_for_quiet_machine,
    write_measurement,
)


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
    from common.engine.parts import assemble_engine
    from common.loader import apply_chat_template
    from common.sampling_params import SamplingParams

    engine = assemble_engine(EngineConfig(device_memory_gb=1.1, dtype="float32",
                                    max_num_batched_tokens=budget,
                                    enable_prefix_caching=prefix_caching), loaded=loaded)
    for i in range(16):
        engine.add_request(str(i), apply_chat_template(loaded.tokenizer, prompt_messages(i)),
                           SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    total = prefill_steps = 0
    prefill_ms, decode_ms = [], []  # one step's wall time, by kind
    per_step = []  # [tokens (prompt computed + sampled), ms] of every step
    started = time.monotonic()
    while engine.has_unfinished_requests():
        # the step's tokens: prompt tokens computed + sampled (vLLM's iteration tokens)
        step_tokens_before = engine.stats.iteration_tokens.total
        generated_before = engine.stats.generation_tokens
        t0 = time.perf_counter()
        engine.step()
        ms = (time.perf_counter() - t0) * 1000
        total += 1
        step_tokens = engine.stats.iteration_tokens.total - step_tokens_before
        prompt = step_tokens - (engine.stats.generation_tokens - generated_before)
        per_step.append([step_tokens, round(ms, 1)])
        if prompt:
            prefill_steps += 1
            prefill_ms.append(ms)
        else:
            decode_ms.append(ms)
    snap = engine.snapshot()
    return {"max_num_batched_tokens": budget, "enable_prefix_caching": prefix_caching,
            "steps": total, "steps_with_prompt_tokens": prefill_steps,
            "decode_only_steps": total - prefill_steps,
            "prompt_tokens_computed": snap["prompt_tokens_by_source"]["local_compute"],
            "prefix_cache_hits_tokens": snap["prefix_cache_hits"],
            "prefix_cache_queries_tokens": snap["prefix_cache_queries"],
            "median_ms_step_with_prompt_tokens": round(statistics.median(prefill_ms), 1),
            "median_ms_decode_only_step": round(statistics.median(decode_ms), 1),
            "first_step_tokens_and_ms": per_step[0],
            "tokens_and_ms_per_step": per_step,
            "wall_s": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8005)
    p.add_argument("--out", type=Path,
                   default=HERE / "results" / f"measured-{datetime.date.today()}.json")
    p.add_argument("--skip-steps", action="store_true", help="only the load tests")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of the 0.75 GiB load with prefix caching, and of each budget")
    add_wait_quiet_args(p, wait_s=180.0, below=0.7)
    args = p.parse_args(argv)
    wait_for_quiet_machine(args.wait_quiet, args.quiet_load)

    load64 = ["--clients", "16", "--max-tokens", "64", "--dtype", "float32"]
    load32 = ["--clients", "16", "--max-tokens", "32", "--dtype", "float32",
              "--device-memory-gb", "1.1"]
    runs = {}
    for i in range(1, args.repeats + 1):  # how many requests hit the cache varies
        runs[f"card_0.75_64_tokens_run{i}"] = [*load64, "--device-memory-gb", "0.75"]
    runs["card_0.75_64_tokens_no_prefix_caching"] = [*load64, "--device-memory-gb", "0.75",
                                                     "--no-enable-prefix-caching"]
    runs["card_1.1_64_tokens"] = [*load64, "--device-memory-gb", "1.1"]
    for i in range(1, args.repeats + 1):  # the two budgets in turn, so both see the same noise
        runs[f"budget_32_run{i}"] = [*load32, "--max-num-batched-tokens", "32"]
        runs[f"budget_512_run{i}"] = [*load32]
    record = {"machine": measurement_machine(), "runs": {}}
    for name, run_args in runs.items():
        print(f"--- {name}", file=sys.stderr, flush=True)
        record["runs"][name] = loadtest(run_args, args.port)
    record["budget_medians"] = {}
    for budget in (32, 512):
        summaries = [r["summary"] for name, r in record["runs"].items()
                     if name.startswith(f"budget_{budget}_")]
        record["budget_medians"][str(budget)] = {
            key: round(statistics.median(s[key] for s in summaries), 2)
            for key in ("output_tokens_per_s", "e2e_p50_s", "e2e_p95_s")}
        record["budget_medians"][str(budget)]["prompt_tokens"] = [
            s["server_stats"]["prompt_tokens"] for s in summaries]
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
    write_measurement(args.out, record)
    print(f"wrote {args.out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
