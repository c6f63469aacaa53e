"""Chapter 09, section 4: faults, with real replicas behind the real router.

Two chapter 09 servers (each its own engine process) behind
`python -m common.entrypoints.router`, round-robin, as a learner runs them:

- one replica killed (SIGKILL, its whole process group) under load: the
  plain requests it held are retried on the other (nothing had reached
  their clients), the streams it was serving end with an error event and
  `[DONE]`, never a hang, and every other request finishes; the router's
  `/health` says which replica is down; restarted on its port, it rejoins
  and gets traffic again;
- one replica stopped (SIGSTOP: a process that answers nothing, slowly
  forever): the poller marks it down when /stats goes unanswered for
  `--replica-timeout-s`, and the requests waiting on it go to the other;
- one request's overload 503 from each replica: it fails alone, and
  nothing in flight is cut (issue 49's cascade, gone).

The counts of each run are printed (`pytest -s`) for the closing note.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from bench.loadtest import ChapterServer, ServerProcess
from common.net import free_port
from tests.conftest import wait_for

pytestmark = pytest.mark.ch09

REPLICA_ARGS = ["--dtype", "float32", "--device-memory-gb", "1.1", "--max-waiting", "4"]
CHAT = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]


class Cluster:
    """Two replicas on fixed ports (a restart reuses its port) and the router."""

    def __init__(self, log_dir):
        self.log_dir = log_dir
        self.ports = [free_port(), free_port()]
        with ThreadPoolExecutor(2) as pool:
            self.replicas = list(pool.map(self.start_replica, range(2)))
        port = free_port()
        self.router = ServerProcess("router", [
            sys.executable, "-m", "common.entrypoints.router", "--port", str(port),
            "--policy", "round-robin", "--replica-timeout-s", "10", "--poll-interval-s", "0.3",
            *[w for p in self.ports for w in ("--replica", f"http://127.0.0.1:{p}")]],
            port, log_dir / "router.log")
        self.url = self.router.url

    def start_replica(self, i: int) -> ChapterServer:
        return ChapterServer("09", self.ports[i], REPLICA_ARGS, self.log_dir / f"replica-{i}.log")

    def health(self) -> dict[str, bool]:
        replicas = requests.get(self.url + "/health", timeout=10).json()["replicas"]
        return {name: r["up"] for name, r in replicas.items()}

    def stats(self) -> dict:
        return requests.get(self.url + "/router/stats", timeout=10).json()

    def stop(self) -> None:
        self.router.stop()
        for replica in self.replicas:
            replica.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("scale-out"))
    yield cluster
    cluster.stop()


def chat(url: str, max_tokens: int) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", timeout=300, json={
        "messages": CHAT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def stream(url: str, max_tokens: int, first_chunk: threading.Event) -> list[dict | str]:
    """A streamed chat: its events, "[DONE]" included."""
    events: list[dict | str] = []
    with requests.post(url + "/v1/chat/completions", stream=True, timeout=300, json={
            "messages": CHAT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}) as answer:
        for line in answer.iter_lines(decode_unicode=True):
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
                first_chunk.set()
    return events


def test_an_overloaded_replicas_503_cuts_nothing_in_flight(cluster):
    """Issue 49, finding 1, with real replicas: one request that asks for
    more sequences than a replica lets wait (67 prompts: 64 slots, a few
    taken, `--max-waiting 4`) gets each replica's overload 503. The streams
    under way on both replicas finish whole, and both stay up."""
    firsts = [threading.Event() for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream, cluster.url, 32, first) for first in firsts]
        wait_for(lambda: all(f.is_set() for f in firsts), "every stream's first chunk")
        overload = requests.post(cluster.url + "/v1/completions", timeout=300, json={
            "prompt": ["Hi"] * 67, "max_tokens": 4})
        streamed = [f.result(timeout=300) for f in streams]
    assert overload.status_code == 503, overload.text
    assert overload.json()["error"]["code"] == "server_overloaded"
    assert all(events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
               for events in streamed)
    assert cluster.health() == {"replica-0": True, "replica-1": True}


def test_a_killed_replica_loses_only_the_streams_it_was_sending(cluster):
    before = cluster.stats()
    firsts = [threading.Event() for _ in range(4)]
    with ThreadPoolExecutor(12) as pool:
        plain = [pool.submit(chat, cluster.url, 150) for _ in range(8)]
        streams = [pool.submit(stream, cluster.url, 150, first) for first in firsts]
        wait_for(lambda: all(f.is_set() for f in firsts), "every stream's first chunk")
        os.killpg(cluster.replicas[1].process.pid, signal.SIGKILL)
        answers = [f.result(timeout=300) for f in plain]
        streamed = [f.result(timeout=300) for f in streams]
    after = cluster.stats()
    assert [a.status_code for a in answers] == [200] * 8, answers[0].text  # retried, not lost
    lost = [events for events in streamed if "error" in events[-2]]
    finished = [events for events in streamed if "error" not in events[-2]
                and events[-2]["choices"][0]["finish_reason"] == "length"]
    assert all(events[-1] == "[DONE]" for events in streamed)  # no hang, no cut
    assert len(lost) + len(finished) == 4 and lost  # round-robin: some were on replica 1
    retries = after["retries"] - before["retries"]
    print(f"\nSIGKILL under load: 8/8 plain answered ({retries} retried elsewhere), "
          f"{len(finished)}/4 streams finished, {len(lost)} ended by an error event")
    assert retries >= 1
    assert after["lost_mid_stream"] - before["lost_mid_stream"] == len(lost)
    wait_for(lambda: cluster.health() == {"replica-0": True, "replica-1": False},
             "the router's /health naming the dead replica")
    assert chat(cluster.url, 4).status_code == 200  # served by the one left


def test_a_restarted_replica_rejoins_and_gets_traffic(cluster):
    if cluster.replicas[1].alive():
        os.killpg(cluster.replicas[1].process.pid, signal.SIGKILL)
    cluster.replicas[1] = cluster.start_replica(1)  # the same port
    wait_for(lambda: cluster.health() == {"replica-0": True, "replica-1": True},
             "the restarted replica up again")
    served = cluster.stats()["served"].get("replica-1", 0)
    for _ in range(4):
        assert chat(cluster.url, 4).status_code == 200
    assert cluster.stats()["served"]["replica-1"] >= served + 2  # round-robin: half


def test_a_stopped_replica_does_not_stall_the_router(cluster):
    group = cluster.replicas[0].process.pid
    before = cluster.stats()
    os.killpg(group, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: chat(cluster.url, 8), range(4)))
        assert [a.status_code for a in answers] == [200] * 4
        after = cluster.stats()
        print(f"\nSIGSTOP: 4/4 answered, {after['retries'] - before['retries']} after a "
              "timeout on the stopped replica")
        assert after["retries"] > before["retries"]  # at least one timed out to the other
        wait_for(lambda: cluster.health()["replica-0"] is False, "the stopped replica down")
    finally:
        os.killpg(group, signal.SIGCONT)
    wait_for(lambda: cluster.health()["replica-0"] is True, "the resumed replica up again")
