"""`make bench-faults`: chapter 09's fault table, measured under load.

Two chapter 09 servers (each with its engine in its own process, one core
each, `--api-key`) behind the router (round-robin, the same key), and a
steady load: `--clients` clients, each sending streamed chats one after
another. Then one fault after another, as an operator or a client breaks
things:

1. a key missing: a client without the key; a second router started
   without the replicas' key;
2. overload: one request that asks for more sequences than a replica lets
   wait (`--max-waiting`), so each replica answers it 503;
3. a slow client: a request's head sent one byte a second;
4. a client hanging up: a plain (not streamed) long request, its
   connection closed once a replica runs it;
5. a replica stopped (SIGSTOP), then resumed (SIGCONT);
6. an engine killed (SIGKILL to one replica's engine process);
7. an API server killed (SIGKILL to one replica's server, not its engine);
8. a replica killed (SIGKILL to its whole process group).

For each: how long until it is seen (by the router, the replica, or the
client: each row says which), and what the load's requests that overlapped
it got: answered whole, ended by an error event (a stream under way), an
HTTP error, or broken (no `[DONE]`: a hang or a cut). A replica lost in
6-8 is started again on its port before the next fault.

Results: bench/results/DATE-HOST-faults.{json,md}. Left out: several
machines, Ray (tests/test_ray.py kills its actors), a fault during a
restart.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Callable

import requests

from bench.loadtest import CHAPTERS, ROOT, ServerProcess
from bench.record import bf16_words, record_head, write_results
from common.net import free_port

RESULTS = ROOT / "bench" / "results"
KEY = "fault-table-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
REPLICA_ARGS = ["--dtype", "float32", "--device-memory-gb", "1.1", "--api-key", KEY,
                "--max-num-seqs", "8", "--max-waiting", "8"]
OVERLOAD = 16  # prompts in one request: more than a busy replica's free slots + 8 waiting
TIMEOUT_READ_S = 10  # the router's --timeout-read in this run
REPLICA_TIMEOUT_S = 3  # the router's --replica-timeout-s in this run
CHAT = [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}]


# ------------------------------------------------------------------ the load
@dataclass
class Outcome:
    start: float
    end: float
    kind: str  # "whole" | "error event" | "HTTP nnn" | "broken"


def one_chat(url: str, max_tokens: int) -> str:
    """A streamed chat through the router, and what its client got."""
    try:
        with requests.post(url + "/v1/chat/completions", headers=AUTH, stream=True,
                           timeout=300, json={"messages": CHAT, "max_tokens": max_tokens,
                                              "ignore_eos": True, "stream": True}) as answer:
            if answer.status_code != 200:
                return f"HTTP {answer.status_code}"
            events = [line[6:] for line in answer.iter_lines(decode_unicode=True)
                      if line.startswith("data: ")]
    except requests.RequestException:
        return "broken"
    if not events or events[-1] != "[DONE]":
        return "broken"
    return "error event" if any('"error"' in e for e in events[:-1]) else "whole"


class Load:
    """`clients` threads, each sending chats one after another until stopped."""

    def __init__(self, url: str, clients: int, max_tokens: int):
        self.outcomes: list[Outcome] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.client, args=(url, max_tokens))
                        for _ in range(clients)]
        for thread in self.threads:
            thread.start()

    def client(self, url: str, max_tokens: int) -> None:
        while not self.stopping.is_set():
            start = time.monotonic()
            kind = one_chat(url, max_tokens)
            self.outcomes.append(Outcome(start, time.monotonic(), kind))

    def overlapping(self, t0: float, t1: float) -> dict[str, int]:
        """What the requests in flight between t0 and t1 got."""
        counts: dict[str, int] = {}
        for o in self.outcomes:
            if o.start < t1 and o.end > t0:
                counts[o.kind] = counts.get(o.kind, 0) + 1
        return counts

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join()


# ------------------------------------------------------------- the servers
class Cluster:
    """Two replicas on fixed ports (a restart reuses its port), one core
    each, and the router in front."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.ports = [free_port(), free_port()]
        self.replicas: list[ServerProcess] = [self.start_replica(i) for i in range(2)]
        self.router = self.start_router("router", KEY)
        self.url = self.router.url

    def start_replica(self, i: int) -> ServerProcess:
        command = ["taskset", "-c", str(i % os.cpu_count()), sys.executable,
                   str(ROOT / CHAPTERS["09"] / "server.py"), "--port", str(self.ports[i]),
                   *REPLICA_ARGS]
        return ServerProcess(f"replica-{i}", command, self.ports[i],
                             self.log_dir / f"replica-{i}.log")

    def router_command(self, port: int, api_key: str | None) -> list[str]:
        return [sys.executable, "-m", "common.entrypoints.router", "--port", str(port),
                "--policy", "round-robin", "--poll-interval-s", "0.1",
                "--replica-timeout-s", str(REPLICA_TIMEOUT_S),
                "--timeout-read", str(TIMEOUT_READ_S),
                *(["--api-key", api_key] if api_key else []),
                *[w for p in self.ports for w in ("--replica", f"http://127.0.0.1:{p}")]]

    def start_router(self, name: str, api_key: str | None) -> ServerProcess:
        port = free_port()
        return ServerProcess(name, self.router_command(port, api_key), port,
                             self.log_dir / f"{name}.log", startup_timeout=120)

    def up(self, url: str | None = None) -> dict[str, bool]:
        replicas = requests.get(f"{url or self.url}/health", timeout=30).json()["replicas"]
        return {name: r["up"] for name, r in replicas.items()}

    def running(self, i: int) -> int:
        return requests.get(f"{self.replicas[i].url}/stats", headers=AUTH,
                            timeout=30).json()["running"]

    def engine_pid(self, i: int) -> int:
        """The replica's engine process: the server's child that multiprocessing
        spawned (the other is multiprocessing's resource tracker)."""
        pid = self.replicas[i].process.pid
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
        raise RuntimeError(f"replica {i} has no engine process")

    def restart(self, i: int) -> None:
        self.replicas[i].stop()
        self.replicas[i] = self.start_replica(i)
        seconds_until(lambda: self.up() == {"replica-0": True, "replica-1": True}, 120)

    def stop(self) -> None:
        self.router.stop()
        for replica in self.replicas:
            replica.stop()


def seconds_until(condition: Callable[[], bool], bound: float = 60.0,
                  since: float | None = None) -> float | None:
    """Seconds until `condition()` holds (polled every 20 ms), counted from
    `since` (a fault's moment; default: now); None: not within the bound (a
    fault never seen, which the row then says)."""
    start = time.monotonic() if since is None else since
    while time.monotonic() - start < bound:
        try:
            if condition():
                return time.monotonic() - start
        except (requests.RequestException, OSError, ValueError):
            pass
        time.sleep(0.02)
    return None


def secs(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.2f} s"


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie (exited, not yet reaped by its parent) has finished too.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


# -------------------------------------------------------------- the faults
def key_missing(cluster: Cluster) -> dict:
    t0 = time.monotonic()
    no_key = requests.post(cluster.url + "/v1/chat/completions", timeout=30,
                           json={"messages": CHAT, "max_tokens": 4})
    answered = time.monotonic() - t0
    port, log = free_port(), cluster.log_dir / "router-without-key.log"
    with log.open("w") as sink:  # not a ServerProcess: its /health never answers 200
        keyless = subprocess.Popen(cluster.router_command(port, None), stdout=sink,
                                   stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        seconds_until(lambda: requests.get(url + "/health", timeout=5) is not None, 120)
        down = seconds_until(lambda: cluster.up(url) == {"replica-0": False,
                                                         "replica-1": False})
        through = requests.post(url + "/v1/chat/completions", headers=AUTH,
                                timeout=30, json={"messages": CHAT, "max_tokens": 4})
        said = "--api-key" in log.read_text()
    finally:
        keyless.terminate()
        keyless.wait(60)
    return {"seen_s": answered, "client_got": f"HTTP {no_key.status_code}",
            "other": f"a router without the key: both replicas down {secs(down)} after "
                     f"it first answers (its first polls), clients get HTTP "
                     f"{through.status_code}"
                     f"{', its log names the flag' if said else ''}"}


def overload(cluster: Cluster) -> dict:
    t0 = time.monotonic()
    answer = requests.post(cluster.url + "/v1/completions", headers=AUTH, timeout=60,
                           json={"prompt": ["Once upon a time"] * OVERLOAD, "max_tokens": 16})
    seen = time.monotonic() - t0
    code = answer.json().get("error", {}).get("code") if answer.status_code != 200 else None
    return {"seen_s": seen, "client_got": f"HTTP {answer.status_code}"
                                          f"{f' {code}' if code else ''}",
            "other": f"{OVERLOAD} prompts at once; replicas up after it: "
                     f"{sum(cluster.up().values())} of 2"}


def slow_client(cluster: Cluster) -> dict:
    port = int(cluster.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 200\r\n\r\n"
    t0 = time.monotonic()
    answer = b""
    for byte in head:  # one byte a second (70 s in all), until the router answers
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            break
        if select.select([sock], [], [], 1.0)[0]:
            answer = sock.recv(65536)
            break
    seen = time.monotonic() - t0
    sock.close()
    status = answer.split(b" ", 2)[1].decode() if answer else "nothing"
    return {"seen_s": seen, "client_got": f"HTTP {status}",
            "other": f"--timeout-read {TIMEOUT_READ_S} s"}


def client_hangs_up(cluster: Cluster) -> dict:
    body = json.dumps({"messages": CHAT, "max_tokens": 600, "ignore_eos": True}).encode()
    port = int(cluster.url.rsplit(":", 1)[1])
    before = [cluster.running(i) for i in range(2)]
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    time.sleep(2.0)  # long enough for a replica to run it
    during = [cluster.running(i) for i in range(2)]
    sock.close()
    t0 = time.monotonic()
    busier = max(range(2), key=lambda i: during[i] - before[i])
    freed = seconds_until(lambda: cluster.running(busier) < during[busier])
    return {"seen_s": freed, "client_got": "(hung up)",
            "other": "seen: the replica's running count falls (its engine aborted it)"}


def replica_stopped(cluster: Cluster) -> dict:
    group = cluster.replicas[0].process.pid
    t0 = time.monotonic()
    os.killpg(group, signal.SIGSTOP)
    try:
        down = seconds_until(lambda: not cluster.up()["replica-0"], since=t0)
    finally:
        os.killpg(group, signal.SIGCONT)
    back = seconds_until(lambda: cluster.up()["replica-0"])
    return {"seen_s": down, "client_got": "",
            "other": f"--replica-timeout-s {REPLICA_TIMEOUT_S}; up again {secs(back)} "
                     "after SIGCONT"}


def engine_killed(cluster: Cluster) -> dict:
    replica, engine = cluster.replicas[1], cluster.engine_pid(1)
    t0 = time.monotonic()
    os.kill(engine, signal.SIGKILL)
    unhealthy = seconds_until(lambda: requests.get(replica.url + "/health",
                                                   timeout=5).status_code == 503, since=t0)
    down = seconds_until(lambda: not cluster.up()["replica-1"], since=t0)
    exit_code = replica.process.wait(60)
    return {"seen_s": down, "client_got": "",
            "other": f"the replica's /health 503 within {secs(unhealthy)}; "
                     f"it exited with status {exit_code}", "restart": 1}


def api_server_killed(cluster: Cluster) -> dict:
    engine = cluster.engine_pid(1)
    t0 = time.monotonic()
    cluster.replicas[1].process.kill()  # the server alone: its engine is orphaned
    gone = seconds_until(lambda: process_gone(engine), since=t0)
    down = seconds_until(lambda: not cluster.up()["replica-1"], since=t0)
    return {"seen_s": down, "client_got": "",
            "other": f"its engine process exited {secs(gone)} after the kill",
            "restart": 1}


def replica_killed(cluster: Cluster) -> dict:
    t0 = time.monotonic()
    os.killpg(cluster.replicas[1].process.pid, signal.SIGKILL)
    down = seconds_until(lambda: not cluster.up()["replica-1"], since=t0)
    return {"seen_s": down, "client_got": "", "other": "", "restart": 1}


# fault -> (what it does, who sees it, the measurement, what vLLM and the
# production routers document for it)
FAULTS: list[tuple[str, str, Callable[[Cluster], dict], str]] = [
    ("key missing", "the client (401 at once)", key_missing,
     "vLLM: 401 from --api-key. production-stack's health checks sent no key "
     "(issue #631): every authenticated replica looked down, as ours did"),
    ("overload", "the client (503 from each replica)", overload,
     "vLLM: no --max-waiting; a full queue waits. llm-d's disruption tests: "
     "pool exhausted, 503, then recovery (llm-d-router #735)"),
    ("slow client", "the router (408)", slow_client,
     "vLLM serves with uvicorn: no read deadline (its keep-alive timeout closes "
     "idle connections only)"),
    ("client hangs up", "the replica (abort)", client_hangs_up,
     "vLLM aborts a request whose client left, streamed or not; a router in "
     "between must pass the hang-up on"),
    ("replica stopped", "the router (its poll)", replica_stopped,
     "production-stack: a health check per endpoint (static routers: PR #428)"),
    ("engine killed", "the router (a 503 engine_dead, then refused)", engine_killed,
     "vLLM: every request in flight errors (EngineDeadError), /health 503 "
     "(PR #24897), the server exits"),
    ("API server killed", "the router (refused)", api_server_killed,
     "vLLM's workers watch a death pipe from their parent "
     "(v1/executor/multiproc_executor.py): ours does the same for its server"),
    ("replica killed", "the router (refused)", replica_killed,
     "llm-d's disruption tests: a pod killed mid-request is rerouted, a stream "
     "ends without a hang (llm-d-router #735)"),
]


def measure(cluster: Cluster, load: Load, settle_s: float) -> list[dict]:
    rows = []
    for name, seen_by, fault, peers in FAULTS:
        time.sleep(settle_s)  # the load in its steady state
        t0 = time.monotonic()
        row = {"fault": name, "seen_by": seen_by, "peers": peers, **fault(cluster)}
        time.sleep(settle_s)  # what the fault did to the requests after it
        row["load"] = load.overlapping(t0, time.monotonic())
        print(f"{name}: {row}", flush=True)
        if row.pop("restart", None) is not None:
            cluster.restart(1)
        rows.append(row)
    return rows


def markdown(record: dict) -> str:
    m = record["machine"]
    lines = [f"# make bench-faults, {record['date']}", "",
             f"{m['cpu']}, {m['cores']} cores, {bf16_words(m)}; `{record['command']}`", "",
             f"Load: {record['clients']} clients sending streamed chats of "
             f"{record['max_tokens']} tokens through the router, one after another. "
             "\"Requests in flight\": those that overlapped the fault's window "
             f"(the fault, then {record['settle_s']:g} s).", "",
             "| fault | seen by | seen after | the faulty request got | requests in flight "
             "| also measured | vLLM and the production routers |",
             "|---|---|---|---|---|---|---|"]
    for r in record["faults"]:
        load = ", ".join(f"{n} {k}" for k, n in sorted(r["load"].items())) or "none"
        lines.append(f"| {r['fault']} | {r['seen_by']} | {secs(r['seen_s'])} | {r['client_got'] or '-'} "
                     f"| {load} | {r['other'] or '-'} | {r['peers']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--settle-s", type=float, default=3.0,
                   help="the load alone before each fault, and after it")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    record = {**record_head(" ".join(["python -m bench.faults", *(argv or sys.argv[1:])])),
              "clients": args.clients, "max_tokens": args.max_tokens,
              "settle_s": args.settle_s}
    with TemporaryDirectory(prefix="bench-faults-") as logs:
        cluster = Cluster(Path(logs))
        try:
            load = Load(cluster.url, args.clients, args.max_tokens)
            try:
                record["faults"] = measure(cluster, load, args.settle_s)
            finally:
                load.stop()
        finally:
            cluster.stop()
    write_results(args.out, "faults", record, markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
