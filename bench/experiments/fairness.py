"""Can one client slow, block or starve the others? Before and after, in one run.

    python -m bench.experiments.fairness --before 9a5445a      # ~6 min on 2 cores

Each scenario is one client doing what a careless or hostile one does, and
a victim whose latency we measure, against the servers of the current tree
("after") and of `--before` (a git revision, checked out in a temporary
worktree and served with the same Python), one after the other:

1. `/stats` pollers: 60 clients loop on `/stats` while a 1,500-token
   prompt with `n: 4` runs (ch06); victims: `/health` (median of 3), a
   1-token chat, and the long request itself (against a run without the
   pollers).
2. A long prefill: a 7,000-token prompt is being prefilled (ch05); victim:
   a short request's time to its one token, sent once the long one runs.
3. A huge `logit_bias`: all 49,152 ids at `n: 16` (ch06); victim: the
   mean gap between a stream's tokens, with the attacker against alone.
4. Half-open connections: 200 clients send a whole head and half a body,
   then wait (ch06); then SIGTERM: seconds until the server exits, and its
   exit status (the "before" server is killed after 60 s).
5. An abandoned request (ch02, the demo card): a client asks for 300
   tokens and hangs up once its reservation is made; victim: seconds until
   a new request is served instead of getting the card's out-of-memory.

Writes bench/results/<date>-<host>-fairness.{md,json} with the machine.
Never run it beside tests or another server: timings need the 2 cores.
"""
from __future__ import annotations

import argparse
import datetime
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import requests

from bench.record import bf16_words, machine
from bench.loadtest import CHAPTERS, ROOT, ServerProcess
from common.net import free_port

RESULTS = ROOT / "bench" / "results"
DEMO_CARD = ["--device-memory-gb", "1.1", "--dtype", "float32"]
ROOMY_CARD = ["--device-memory-gb", "4", "--dtype", "float32"]


def chat_body(content: str, max_tokens: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def timed_post(url: str, body: dict, timeout: float = 600) -> tuple[float, int]:
    start = time.monotonic()
    response = requests.post(url + "/v1/chat/completions", json=body, timeout=timeout)
    return time.monotonic() - start, response.status_code


class Background(threading.Thread):
    """`work()` on a thread; `result` holds what it returned, `error` what it raised."""

    def __init__(self, work):
        super().__init__(daemon=True)
        self.work, self.result, self.error = work, None, None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.work()
        except Exception as exc:  # noqa: BLE001 - reported by wait_running
            self.error = exc


def wait_running(url: str, request: Background, count: int = 1) -> None:
    """Until `count` sequences run; fails if `request` ended first."""
    while requests.get(url + "/stats", timeout=600).json()["running"] < count:
        if not request.is_alive():
            raise RuntimeError(f"the request ended before it was seen running: "
                               f"{request.result or request.error!r}")
        time.sleep(0.05)


# ------------------------------------------------------------ the scenarios
def long_request_with(url: str, num_pollers: int) -> dict:
    """A 1,500-token prompt with `n: 4` (a fresh one: no prefix-cache hit),
    `num_pollers` clients looping on /stats meanwhile; then 3 /health
    probes and a 1-token chat. Seconds for each."""
    nonce = time.time_ns()
    long = Background(lambda: timed_post(url, chat_body(f"{nonce} " + "the sea is blue. " * 300,
                                                           8, n=4)))
    wait_running(url, long)
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            requests.get(url + "/stats", timeout=600)

    pollers = [Background(poll) for _ in range(num_pollers)]
    health = []
    for _ in range(3):
        start = time.monotonic()
        requests.get(url + "/health", timeout=600)
        health.append(time.monotonic() - start)
    chat, _ = timed_post(url, chat_body(f"Hi {nonce}", 1))
    long.join()
    stop.set()
    for thread in pollers:
        thread.join()
    return {"health_s": statistics.median(health), "chat_s": chat, "long_s": long.result[0]}


def stats_pollers(url: str) -> dict:
    alone, flooded = long_request_with(url, 0), long_request_with(url, 60)
    return {"health_s": flooded["health_s"], "chat_s": flooded["chat_s"],
            "long_s": flooded["long_s"], "long_alone_s": alone["long_s"]}


def long_prefill(url: str) -> dict:
    idle, _ = timed_post(url, chat_body("Hi", 1))
    long = Background(lambda: timed_post(url, chat_body("the sea is blue. " * 1400, 1)))
    wait_running(url, long)
    busy, _ = timed_post(url, chat_body("Hi", 1))
    long.join()
    return {"newcomer_ttft_s": busy, "idle_ttft_s": idle, "long_s": long.result[0]}


def stream_gaps(url: str) -> float:
    """Mean seconds between a 32-token stream's chunks."""
    body = chat_body("Tell me about the sea.", 32, stream=True, ignore_eos=True)
    times = []
    with requests.post(url + "/v1/chat/completions", json=body, stream=True,
                       timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith(b"data: {"):
                times.append(time.monotonic())
    gaps = [b - a for a, b in zip(times[1:], times[2:])]  # after the role chunk
    return statistics.mean(gaps)


def huge_logit_bias(url: str) -> dict:
    alone = stream_gaps(url)
    bias = {str(i): 0.1 for i in range(49152)}
    attacker = Background(lambda: timed_post(url, chat_body(
        "Write a long story.", 48, n=16, logit_bias=bias, ignore_eos=True, temperature=1.0)))
    wait_running(url, attacker, 16)
    attacked = stream_gaps(url)
    attacker.join()
    return {"victim_gap_s": attacked, "alone_gap_s": alone}


def half_open_then_sigterm(server: ServerProcess) -> dict:
    port = int(server.url.rsplit(":", 1)[1])
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: 200\r\n\r\n{")
    sockets = []
    for _ in range(200):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(head)
        sockets.append(sock)
    time.sleep(1)
    start = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    try:
        status = server.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        status = None
    seconds = time.monotonic() - start
    for sock in sockets:
        sock.close()
    return {"exit_s": seconds if status is not None else None, "exit_status": status}


def abandoned_request(url: str) -> dict:
    body = json.dumps(chat_body("Tell me about the sea.", 300, ignore_eos=True))
    host, port = url.split("//")[1].split(":")
    conn = socket.create_connection((host, int(port)))
    conn.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
    time.sleep(3)  # its reservation is made within a second or two
    conn.close()
    start = time.monotonic()
    refused = 0
    while timed_post(url, chat_body("Hi", 1))[1] != 200:
        refused += 1
        time.sleep(0.25)
    return {"served_after_s": time.monotonic() - start, "refused": refused}


# ------------------------------------------------------------------ servers
@contextmanager
def serve(tree: Path, chapter: str, args: list[str], log_dir: Path, label: str):
    port = free_port()
    command = [sys.executable, str(tree / CHAPTERS[chapter] / "server.py"), "--port", str(port),
               *args]
    server = ServerProcess(f"{label} ch{chapter}", command, port,
                           log_dir / f"{label}-ch{chapter}.log")
    try:
        yield server
    finally:
        server.stop()


def run_tree(tree: Path, label: str, log_dir: Path) -> dict:
    figures = {}
    print(f"[{label}] 1-3: /stats pollers, huge logit_bias (ch06); long prefill (ch05)",
          flush=True)
    with serve(tree, "06", ROOMY_CARD, log_dir, label) as server:
        figures["stats_pollers"] = stats_pollers(server.url)
        figures["huge_logit_bias"] = huge_logit_bias(server.url)
    with serve(tree, "05", ROOMY_CARD, log_dir, label) as server:
        figures["long_prefill"] = long_prefill(server.url)
    print(f"[{label}] 4-5: half-open connections (ch06); abandoned request (ch02)", flush=True)
    with serve(tree, "06", ROOMY_CARD, log_dir, label) as server:
        figures["half_open"] = half_open_then_sigterm(server)
    with serve(tree, "02", DEMO_CARD, log_dir, label) as server:
        figures["abandoned"] = abandoned_request(server.url)
    return figures


@contextmanager
def worktree(revision: str):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(path), revision], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT,
                           check=False, capture_output=True)


# ------------------------------------------------------------------ report
ROWS = [  # (scenario, figure, what)
    ("stats_pollers", "health_s", "1. /health, s (60 clients loop on /stats)"),
    ("stats_pollers", "chat_s", "1. a 1-token chat sent after 3 /health probes, s (same)"),
    ("stats_pollers", "long_s", "1. the n=4 request they run beside, s (same)"),
    ("stats_pollers", "long_alone_s", "1. the same request without the pollers, s"),
    ("long_prefill", "newcomer_ttft_s", "2. a newcomer's first token, s (7,000-token prefill)"),
    ("long_prefill", "idle_ttft_s", "2. the same on an idle server, s"),
    ("long_prefill", "long_s", "2. the 7,000-token request itself, s"),
    ("huge_logit_bias", "victim_gap_s", "3. a stream's inter-token gap, s (logit_bias attacker)"),
    ("huge_logit_bias", "alone_gap_s", "3. the same stream alone, s"),
    ("half_open", "exit_s", "4. SIGTERM to exit, s (200 half-open connections)"),
    ("half_open", "exit_status", "4. exit status"),
    ("abandoned", "served_after_s", "5. ch02: next request served, s after a hang-up"),
    ("abandoned", "refused", "5. ch02: out-of-memory answers meanwhile"),
]


def fmt(value) -> str:
    if value is None:
        return "did not exit in 60 s"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def render(rec: dict) -> str:
    m = rec["machine"]
    lines = [f"# Fairness, before and after ({rec['date']})", "",
             f"`{rec['command']}`, {rec['duration_s']:.0f} s.", "",
             f"Machine: {m['cpu']}, {m['cores']} cores ({bf16_words(m)}); torch {m['torch']}, "
             f"Python {m['python']}.", "",
             f"Before: `{rec['before']}`; after: `{rec['after']}`.", "",
             "| figure | before | after |", "|---|---|---|"]
    for scenario, key, what in ROWS:
        lines.append(f"| {what} | {fmt(rec['runs']['before'][scenario][key])} | "
                     f"{fmt(rec['runs']['after'][scenario][key])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="git revision to compare with")
    args = parser.parse_args(argv)
    when, start = datetime.datetime.now(), time.monotonic()
    after = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.strip()
    logs = Path(tempfile.mkdtemp(prefix="fairness-"))
    print(f"server logs: {logs}", flush=True)
    with worktree(args.before) as before_tree:
        runs = {"before": run_tree(before_tree, "before", logs),
                "after": run_tree(ROOT, "after", logs)}
    rec = {"date": when.isoformat(timespec="seconds"),
           "command": "python -m bench.experiments.fairness " + " ".join(argv or sys.argv[1:]),
           "before": args.before, "after": after, "duration_s": time.monotonic() - start,
           "machine": machine(), "runs": runs}
    stem = RESULTS / f"{when:%Y-%m-%d}-{rec['machine']['host']}-fairness"
    stem.with_suffix(".json").write_text(json.dumps(rec, indent=2) + "\n")
    stem.with_suffix(".md").write_text(render(rec))
    print(render(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
