"""The one load test every chapter is run against (ch02).

    python -m bench.loadtest --url http://127.0.0.1:8000 --clients 8 --requests 2
    python -m bench.loadtest --chapter 05 --clients 32 --device-memory-gb 1.1

N concurrent clients each send R chat requests, one after another, with
prompts from a fixed set (all sharing one system prompt, as real apps do).
With `--chapter` it starts that chapter's server on the card first and stops
it afterwards. It reports successes, failures (with their first distinct
messages), output tokens/s, TTFT and end-to-end latency p50/p95, plus the
server's own `/stats` (KV reserved vs used, waste) when it has them.

It never hangs: every request has a timeout and the whole run a deadline.
Figures follow vLLM's benchmark definitions: TTFT (time to first token,
streaming only), TPOT (time per output token after the first), ITL (gap
between streamed chunks), e2e latency, output tokens/s = all completion
tokens / wall time of the run.

Two ways to end a run, on the same clients (`drive_clients`): after R
requests per client (`run_load`, this command), or after a duration
(`run_for_duration`: each client sends its next request until the
duration has passed, then stops; the answers in flight are waited for and
counted, as vLLM's benchmark counts them; bench/vs_vllm.py).

Left out: open-loop arrivals at a fixed request rate (clients here are
closed-loop: each waits for its answer before sending the next).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import requests

from common.entrypoints.chapters import CHAPTER_FOLDERS
from common.net import free_port

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = CHAPTER_FOLDERS  # "05" -> "05-continuous-batching"
SYSTEM_PROMPT = "You are a concise assistant. Answer in two or three sentences."
PROMPTS = [
    "What is the capital of France?",
    "Tell me a story about a robot who learns to paint.",
    "Explain what a GPU is to a ten-year-old.",
    "Give me three tips to sleep better.",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "What does a compiler do?",
    "How do plants make food from sunlight?",
    "Summarize the plot of Romeo and Juliet.",
    "What is the difference between a list and a tuple in Python?",
    "Describe a good breakfast.",
    "Why do cats purr?",
    "What is machine learning?",
    "Name three famous painters and one work by each.",
    "How does a bicycle stay upright?",
    "What should I pack for a weekend in the mountains?",
]


def prompt_messages(i: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    e2e: float = 0.0
    ttft: float | None = None
    completion_tokens: int = 0
    itls: list[float] = field(default_factory=list)


def _error_text(response: requests.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except Exception:  # noqa: BLE001 - any non-envelope body
        return response.text[:300]


def stream_request(url: str, body: dict, timeout: float
                   ) -> tuple[RequestResult, str, Mapping[str, str]]:
    """One chat request, streamed: its timings, its answer's text, and the
    answer's HTTP headers (a router's `x-replica`: bench/scale.py)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    chunk_times: list[float] = []
    text: list[str] = []
    tokens = 0
    with requests.post(url, json=body, stream=True, timeout=timeout) as response:
        headers = response.headers
        if response.status_code != 200:
            return (RequestResult(False, f"HTTP {response.status_code}: "
                                  f"{_error_text(response)}"), "", headers)
        if not headers.get("content-type", "").startswith("text/event-stream"):
            return (RequestResult(False, "the server answered without streaming "
                                  "(chapters 01-05 do not stream; chapter 06 does)"), "", headers)
        for line in response.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                return (RequestResult(False, f"stream error: {event['error'].get('message')}"),
                        "", headers)
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            piece = "".join(c.get("delta", {}).get("content") or ""
                            for c in event.get("choices", []))
            if piece:
                chunk_times.append(time.perf_counter())
                text.append(piece)
    end = time.perf_counter()
    ttft = chunk_times[0] - start if chunk_times else end - start
    itls = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    return (RequestResult(True, e2e=end - start, ttft=ttft,
                          completion_tokens=tokens or len(chunk_times), itls=itls),
            "".join(text), headers)


def send_one(base_url: str, index: int, max_tokens: int, stream: bool,
             timeout: float, model: str | None, ignore_eos: bool = True) -> RequestResult:
    """One chat request. `ignore_eos` (a vLLM extra, which our servers and
    llama.cpp's know) makes every answer `max_tokens` long; a server that
    refuses it is loaded without it (bench.measure.probe), and the tokens counted
    are always those its `usage` reports."""
    body = {"messages": prompt_messages(index), "max_tokens": max_tokens,
            "temperature": 0.0}
    if ignore_eos:
        body["ignore_eos"] = True
    if model:
        body["model"] = model
    url = base_url.rstrip("/") + "/v1/chat/completions"
    try:
        if stream:
            return stream_request(url, body, timeout)[0]
        start = time.perf_counter()
        response = requests.post(url, json=body, timeout=timeout)
        e2e = time.perf_counter() - start
        if response.status_code != 200:
            return RequestResult(False, f"HTTP {response.status_code}: {_error_text(response)}")
        usage = (response.json().get("usage") or {}).get("completion_tokens")
        if usage is None:
            return RequestResult(False, "the answer has no usage.completion_tokens")
        return RequestResult(True, e2e=e2e, completion_tokens=usage)
    except requests.RequestException as exc:
        return RequestResult(False, f"{type(exc).__name__}: {exc}")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def summarize(results: list[RequestResult], wall: float) -> dict:
    good = [r for r in results if r.ok]
    errors: list[str] = []
    for r in results:
        if not r.ok and r.error not in errors:
            errors.append(r.error)
    tokens = sum(r.completion_tokens for r in good)
    ttfts = [r.ttft for r in good if r.ttft is not None]
    tpots = [(r.e2e - r.ttft) / (r.completion_tokens - 1)
             for r in good if r.ttft is not None and r.completion_tokens > 1]
    itls = [x for r in good for x in r.itls]
    e2es = [r.e2e for r in good]
    return {
        "completed": len(good), "failed": len(results) - len(good),
        "first_errors": errors[:3], "duration_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "requests_per_s": len(good) / wall if wall > 0 else 0.0,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95),
        "tpot_mean_s": statistics.fmean(tpots) if tpots else None,
        "itl_p50_s": percentile(itls, 50), "itl_p95_s": percentile(itls, 95),
        "e2e_p50_s": percentile(e2es, 50), "e2e_p95_s": percentile(e2es, 95),
    }


def port_is_free(port: int) -> bool:
    """Nobody listens on it. SO_REUSEADDR, as uvicorn binds: the closed
    connections of a server just stopped (TIME_WAIT) do not count."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def fetch_stats(base_url: str) -> dict | None:
    try:
        response = requests.get(base_url.rstrip("/") + "/stats", timeout=5)
        return response.json() if response.status_code == 200 else None
    except requests.RequestException:
        return None


def served_model(url: str) -> str | None:
    """The first model id of the server's /v1/models (None if it has none)."""
    try:
        response = requests.get(url + "/v1/models", timeout=10)
        return response.json()["data"][0]["id"] if response.status_code == 200 else None
    except (requests.RequestException, ValueError, KeyError, IndexError, TypeError):
        return None


def drive_clients(clients: int, send: Callable[[int, int], RequestResult],
                  go_on: Callable[[int, float], bool],
                  clock: Callable[[], float] = time.perf_counter,
                  progress=None) -> tuple[list[RequestResult], float]:
    """Every client at once, each sending its requests one after another:
    client c sends request r (`send(c, r)`, r = 0, 1, ...) while
    `go_on(r, seconds since the start)` says so. Returns the results and
    the wall time, from the start to the last answer."""
    results: list[RequestResult] = []
    lock = threading.Lock()
    start = clock()

    def client(c: int) -> None:
        r = 0
        while go_on(r, clock() - start):
            result = send(c, r)
            with lock:
                results.append(result)
            if progress is not None:
                progress.update(1)
            r += 1

    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(client, range(clients)))
    return results, clock() - start


def run_load(base_url: str, clients: int, requests_per_client: int, max_tokens: int,
             stream: bool = False, timeout: float = 600.0, deadline: float = 1800.0,
             model: str | None = None, progress=None, ignore_eos: bool = True) -> dict:
    """Run the load; returns the summary dict (plus the server's /stats)."""
    stop_at = time.monotonic() + deadline

    def send(c: int, r: int) -> RequestResult:
        remaining = stop_at - time.monotonic()
        if remaining <= 0:
            return RequestResult(False, "load test deadline reached")
        return send_one(base_url, c * requests_per_client + r, max_tokens, stream,
                        min(timeout, remaining), model, ignore_eos)

    results, wall = drive_clients(clients, send, lambda r, _: r < requests_per_client,
                                  progress=progress)
    summary = summarize(results, wall)
    summary["server_stats"] = fetch_stats(base_url)
    summary["load"] = {"clients": clients, "requests_per_client": requests_per_client,
                       "max_tokens": max_tokens, "stream": stream}
    return summary


def run_for_duration(send: Callable[[int, int], RequestResult], clients: int,
                     duration_s: float = 30.0, clock: Callable[[], float] = time.perf_counter,
                     progress=None) -> dict:
    """Steady state: each client sends its next request (`send(c, r)`)
    until `duration_s` has passed since the start, then stops sending; the
    answers in flight are waited for and counted. Output tokens/s = tokens /
    wall time of the run (vLLM's definition). `clock`: the tests' own."""
    results, wall = drive_clients(clients, send, lambda _, elapsed: elapsed < duration_s,
                                  clock, progress)
    summary = summarize(results, wall)
    summary["load"] = {"clients": clients, "steady_s": duration_s}
    return summary


# ------------------------------------------------- starting a chapter server
def kill_process_group(pid: int) -> None:
    """SIGKILL whatever is left of the process group a `start_new_session`
    child leads (its workers); nothing if the group is gone already."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class ServerProcess:
    """Start a server command on a port, wait until its /health answers 200,
    stop it. `name` says which server in the errors. The server runs in a
    process group of its own, stopped whole: a server that spawns workers
    (the real vLLM's engine core, tensor-parallel ranks) leaves none behind."""

    def __init__(self, name: str, command: list[str], port: int, log_path: Path,
                 startup_timeout: float = 300.0, env: dict[str, str] | None = None):
        self.name = name
        if not port_is_free(port):  # else /health would answer for another server
            raise RuntimeError(f"port {port} is already in use: give another --port")
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        env = {**(env or os.environ), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env, cwd=ROOT, start_new_session=True)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_tail()
                self.stop()  # what it spawned may outlive it (vLLM's engine core)
                raise RuntimeError(f"{self.name} server exited at startup; log:\n{tail}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} server did not start in {timeout:.0f} s")

    def log_tail(self, lines: int = 15) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """SIGTERM to the server (it stops its own workers), then SIGKILL to
        whatever is left of its process group."""
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        kill_process_group(self.process.pid)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class ChapterServer(ServerProcess):
    """Start `<chapter>/server.py` on a port, wait until it answers, stop it."""

    def __init__(self, chapter: str, port: int, server_args: list[str],
                 log_path: Path, startup_timeout: float = 300.0):
        self.chapter = CHAPTERS.get(chapter, chapter)
        command = [sys.executable, str(ROOT / self.chapter / "server.py"),
                   "--port", str(port), *server_args]
        super().__init__(self.chapter, command, port, log_path, startup_timeout)


# ------------------------------------------------------------ reporting
def _fmt(value, unit: str = "", scale: float = 1.0) -> str:
    if value is None:
        return "-"
    return f"{value * scale:.2f}{unit}"


def format_table(summary: dict) -> str:
    rows = [
        ("completed / failed", f"{summary['completed']} / {summary['failed']}"),
        ("output tokens/s", _fmt(summary["output_tokens_per_s"])),
        ("requests/s", _fmt(summary["requests_per_s"])),
        ("TTFT p50 / p95", f"{_fmt(summary['ttft_p50_s'], ' s')} / "
                           f"{_fmt(summary['ttft_p95_s'], ' s')}"),
        ("TPOT mean", _fmt(summary["tpot_mean_s"], " ms", 1000)),
        ("ITL p50 / p95", f"{_fmt(summary['itl_p50_s'], ' ms', 1000)} / "
                          f"{_fmt(summary['itl_p95_s'], ' ms', 1000)}"),
        ("e2e p50 / p95", f"{_fmt(summary['e2e_p50_s'], ' s')} / "
                          f"{_fmt(summary['e2e_p95_s'], ' s')}"),
    ]
    stats = summary.get("server_stats") or {}
    if "avg_kv_waste_perc" in stats:
        rows.append(("server: KV waste (avg)", f"{stats['avg_kv_waste_perc']:.1f} %"))
        rows.append(("server: peak running seqs", str(stats.get("peak_running", "-"))))
        rows.append(("server: preemptions", str(stats.get("num_preemptions", "-"))))
    width = max(len(name) for name, _ in rows)
    lines = [f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {name.ljust(width)} | {value} |" for name, value in rows]
    for error in summary["first_errors"]:
        lines.append(f"first error: {error}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start --chapter)")
    parser.add_argument("--chapter", help="01..06: start that chapter's server")
    parser.add_argument("--port", type=int, default=None,
                        help="for the started server (default: a free port)")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--requests", type=int, default=1, help="per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, s")
    parser.add_argument("--deadline", type=float, default=1800.0, help="whole run, s")
    parser.add_argument("--device-memory-gb", type=float, default=None,
                        help="the card, when starting a chapter's server")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args, server_args = parser.parse_known_args(argv)
    if args.device_memory_gb is not None:
        server_args += ["--device-memory-gb", str(args.device_memory_gb)]
    if not args.url and not args.chapter:
        parser.error("give --url of a running server or --chapter to start one")

    def run(url: str) -> dict:
        print(f"load: {args.clients} clients x {args.requests} requests, "
              f"{args.max_tokens} tokens each, stream={args.stream} -> {url}", flush=True)
        return run_load(url, args.clients, args.requests, args.max_tokens, args.stream,
                        args.timeout, args.deadline)

    if args.url:
        summary = run(args.url)
    else:
        port = args.port or free_port()
        log_path = Path(f"/tmp/loadtest-ch{args.chapter}-{port}.log")
        with ChapterServer(args.chapter, port, server_args, log_path) as server:
            summary = run(server.url)
            summary["server_alive_after"] = server.alive()
            print(f"--- server log ({log_path}), last lines ---\n{server.log_tail()}\n---")
    print(format_table(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
