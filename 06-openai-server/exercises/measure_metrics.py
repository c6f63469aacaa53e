"""Measure the answers of exercise 06's "Predict, then measure" (solutions.md).

    flock /tmp/cpu.lock .venv/bin/python 06-openai-server/exercises/measure_metrics.py

The README's run, scripted: chapter 06's server on the demo card
(`06-openai-server/server.py --port PORT --device-memory-gb 1.1 --dtype
float32`, prefix caching on, its default), then the load test of 16
streaming clients x 64 tokens (`python -m bench.loadtest --url ... --clients
16 --max-tokens 64 --stream`) while `/metrics` is scraped every 2 s, then
the whole `/metrics` once the load is done. About a minute on 2 quiet cores.
`--no-enable-prefix-caching`: the same without the prefix cache (the
answers as they were before chapter 05 turned it on). It first waits (up
to `--wait-quiet` seconds) for the load average to fall below 0.7 (`--quiet-load`).

Writes, beside this file:
- `results/measured-DATE-metrics.txt`: the machine and the commands, every
  scrape (`--- t=N s`: the gauges, the generation and TTFT counters), then
  the whole final `/metrics`, then the derived means (`_sum / _count`);
- `results/measured-DATE-load.json`: the commands, the machine, the load
  test's summary and the server's `/stats`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import (  # noqa: E402
    add_wait_quiet_args,
    bf16_words,
    measurement_machine,
    wait_for_quiet_machine,
    write_measurement,
)
SCRAPED = re.compile(r"^vllm:(num_requests_(running|waiting)|kv_cache_usage_perc|"
                     r"generation_tokens_total|prompt_tokens_total|prefix_cache_hits_total|"
                     r"time_to_first_token_seconds_count)\{")


def wait_up(base: str, server: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError("the server exited at startup (see its log)")
        try:
            if requests.get(base + "/stats", timeout=2).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise RuntimeError("the server did not answer in time")


def metric_value(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--every", type=float, default=2.0, help="seconds between scrapes")
    p.add_argument("--date", default=datetime.date.today().isoformat())
    p.add_argument("--no-enable-prefix-caching", action="store_true",
                   help="pass it to the server (files named ...-no-prefix-caching-...)")
    add_wait_quiet_args(p, wait_s=180.0, below=0.7)
    args = p.parse_args(argv)
    wait_for_quiet_machine(args.wait_quiet, args.quiet_load)
    base = f"http://127.0.0.1:{args.port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server_cmd = ["06-openai-server/server.py", "--port", str(args.port),
                  "--device-memory-gb", "1.1", "--dtype", "float32"]
    stem = f"measured-{args.date}"
    if args.no_enable_prefix_caching:
        server_cmd.append("--no-enable-prefix-caching")
        stem += "-no-prefix-caching"
    load_cmd = ["-m", "bench.loadtest", "--url", base, "--clients", "16",
                "--max-tokens", "64", "--stream"]
    info = measurement_machine()
    log_path = Path(f"/tmp/measure-metrics-ch06-{args.port}.log")
    out = []
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, *server_cmd], cwd=ROOT, env=env,
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_up(base, server)
            out.append(f"server up {time.strftime('%H:%M:%S')}")
            with tempfile.NamedTemporaryFile(suffix=".json") as summary_file:
                start = time.monotonic()
                load = subprocess.Popen([sys.executable, *load_cmd, "--json", summary_file.name],
                                        cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
                while True:
                    t = time.monotonic() - start
                    text = requests.get(base + "/metrics", timeout=10).text
                    out.append(f"--- t={t:.1f} s")
                    out += [line for line in text.splitlines() if SCRAPED.match(line)]
                    if load.poll() is not None:
                        break
                    time.sleep(max(0.0, args.every - (time.monotonic() - start - t)))
                load_output = load.communicate()[0]
                summary = json.loads(Path(summary_file.name).read_text())
            final = requests.get(base + "/metrics", timeout=10).text
        finally:
            server.terminate()
            server.wait(timeout=60)
    kv_line = next((line[line.index("KV cache:"):] for line in log_path.read_text().splitlines()
                    if "KV cache:" in line), None)
    means = {}
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds"):
        total = metric_value(final, f"vllm:{name}_sum")
        count = metric_value(final, f"vllm:{name}_count")
        means[name] = (total, count, total / count if count else float("nan"))

    commands = {"server": "python " + " ".join(server_cmd),
                "load": "python " + " ".join(load_cmd),
                "scrapes": f"curl {base}/metrics every {args.every:g} s while the load runs, "
                           "then once after it",
                "script": "python 06-openai-server/exercises/measure_metrics.py "
                          f"--port {args.port}"
                          + (" --no-enable-prefix-caching" if args.no_enable_prefix_caching
                             else "")}
    header = [f"# {args.date}: {info['cpu']}, {info['cores']} cores, {bf16_words(info)}, "
              f"load average at start "
              f"{info['load_average_at_start'][0]:.2f}",
              *[f"# {k}: {v}" for k, v in commands.items()],
              f"# {kv_line}"]
    tail = ["--- final", *[line for line in final.splitlines() if not line.startswith("#")],
            "--- means (_sum / _count)",
            *[f"{name}: {s:.4f} / {c:.0f} = {m:.4f} s" for name, (s, c, m) in means.items()]]
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    (results / f"{stem}-metrics.txt").write_text(
        "\n".join(header + out + tail) + "\n")
    record = {"command": f"{commands['server']}, then {commands['load']} "
                         f"(06-openai-server/exercises/measure_metrics.py)",
              "commands": commands, "machine": info, "kv_cache_line": kv_line,
              "load_test_output": load_output.splitlines()[-12:], "summary": summary}
    write_measurement(results / f"{stem}-load.json", record)
    print("\n".join(out[-8:] + tail[-5:]))
    print(f"wrote results/{stem}-metrics.txt and -load.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
