"""ch09: the replicas as Ray actors behind the router, on a real Ray cluster
(common/entrypoints/ray_replicas.py, the process that `make ray-serve` runs).

The cluster has two nodes on this machine, a head and a worker, as
`make ray-up` on one machine and `ray start --address=<head-ip>:6379` on a
second one make. Two replicas of chapter 09's real server (the embedded
model, float32, a small card) serve behind the router. Skipped, with Ray's
own reason, only if Ray cannot start here.

One cluster and one `ray_replicas` process serve the whole module, and its
tests run in order: both replicas serve; one actor is killed for good;
the other is killed and Ray restarts it; SIGTERM stops everything. Each waits
for an event (the router's /health, a line of the log), never for a time.
"""
from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
import requests

from bench.loadtest import kill_process_group
from common.entrypoints.ray_replicas import NAMESPACE
from common.net import free_port
from tests.conftest import PROMPTS, ROOT, openai_client, wait_for

SERVER_FLAGS = ["--dtype", "float32", "--device-memory-gb", "1.1", "--engine-core", "in-process"]
STARTUP_S = 300.0  # bounds a failure only: two servers load the model on 2 cores


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of 4 logical CPUs each: room for both replicas on one
    node, so only the SPREAD strategy puts them on different nodes."""
    from ray.cluster_utils import Cluster
    cluster = Cluster()
    try:
        cluster.add_node(num_cpus=4, include_dashboard=False)  # the head
        cluster.add_node(num_cpus=4)  # a second machine, in miniature
        cluster.wait_for_nodes()
        cluster.connect(namespace=NAMESPACE)
    except Exception as exc:  # noqa: BLE001 - whatever stops Ray, the skip says it
        cluster.shutdown()
        pytest.skip(f"Ray cannot start here: {type(exc).__name__}: {exc}")
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()  # every node's processes: actors, workers, servers


@dataclass
class Deployment:
    """The `ray_replicas` process: its router's URL and its log."""
    process: subprocess.Popen
    url: str
    log_path: Path

    def health(self) -> dict[str, dict]:
        """The router's view of each replica: {"replica-0": {"url":, "up":, "load":}}."""
        try:
            return requests.get(f"{self.url}/router/stats", timeout=5).json()["replicas"]
        except (requests.RequestException, ValueError):
            return {}

    def up(self) -> set[str]:
        return {name for name, replica in self.health().items() if replica["up"]}

    def served(self) -> dict[str, int]:
        return requests.get(f"{self.url}/router/stats", timeout=5).json()["served"]

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> int:
        """SIGTERM, as Ctrl-C or `kill` would; SIGKILL if it hangs."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.process.kill()
        kill_process_group(self.process.pid)
        return self.process.wait()


@pytest.fixture(scope="module")
def deployment(cluster, tmp_path_factory):
    """Two replicas on the cluster, round-robin behind the router (the other
    policies are tests/test_router.py's): two requests, one per replica."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("ray") / "ray_replicas.log"
    command = [sys.executable, "-m", "common.entrypoints.ray_replicas",
               "--address", cluster.address, "--replicas", "2", "--chapter", "09",
               "--policy", "round-robin", "--poll-interval-s", "0.2",
               "--router-port", str(port), *SERVER_FLAGS]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                   start_new_session=True)
    deployment = Deployment(process, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_for(lambda: deployment.up() == {"replica-0", "replica-1"}
                 or process.poll() is not None, "both replicas up behind the router", STARTUP_S)
        assert process.poll() is None, f"ray_replicas exited:\n{deployment.log_tail()}"
        yield deployment
    finally:
        deployment.stop()


def replica(name: str):
    return ray.get_actor(name, namespace=NAMESPACE)


def ask(url: str) -> str:
    """A greedy chat completion with the official client."""
    answer = openai_client(url).chat.completions.create(
        model="smollm2", messages=PROMPTS[0], max_tokens=12, temperature=0)
    return answer.choices[0].message.content


def ask_counting(deployment: Deployment, count: int) -> dict[str, int]:
    """Send requests through the router; how many each replica served."""
    before = deployment.served()
    for _ in range(count):
        assert ask(deployment.url)
    after = deployment.served()
    return {name: after.get(name, 0) - before.get(name, 0) for name in after
            if after.get(name, 0) != before.get(name, 0)}


def test_the_replicas_are_spread_over_the_nodes_and_answer_alike(deployment):
    nodes = ray.get([replica(f"replica-{i}").node_id.remote() for i in range(2)])
    assert nodes[0] != nodes[1], "SPREAD: one replica per node"
    urls = [deployment.health()[f"replica-{i}"]["url"] for i in range(2)]
    assert urls == ray.get([replica(f"replica-{i}").url.remote() for i in range(2)])
    through_router = ask(deployment.url)
    assert through_router and [ask(url) for url in urls] == [through_router, through_router]
    assert ask_counting(deployment, 2) == {"replica-0": 1, "replica-1": 1}


def test_an_actor_killed_for_good_stays_down_and_the_other_serves(deployment):
    ray.kill(replica("replica-1"))  # no restart
    wait_for(lambda: deployment.up() == {"replica-0"}, "the router to mark replica-1 down")
    wait_for(lambda: "replica-1 is dead for good" in deployment.log_path.read_text(),
             "the driver to see replica-1 dead for good")
    assert ask_counting(deployment, 3) == {"replica-0": 3}
    assert requests.get(f"{deployment.url}/health", timeout=5).status_code == 200


def test_an_actor_killed_is_restarted_by_ray_and_gets_traffic_back(deployment):
    old_url = deployment.health()["replica-0"]["url"]
    ray.kill(replica("replica-0"), no_restart=False)  # as if its worker had crashed
    wait_for(lambda: requests.get(f"{deployment.url}/health", timeout=5).status_code == 503,
             "the router to see no replica up")
    wait_for(lambda: deployment.up() == {"replica-0"}, "replica-0 restarted", STARTUP_S)
    new_url = deployment.health()["replica-0"]["url"]
    assert new_url != old_url and new_url == ray.get(replica("replica-0").url.remote())
    assert "replica-0 was restarted by Ray" in deployment.log_path.read_text()
    assert ask_counting(deployment, 2) == {"replica-0": 2}


def test_sigterm_stops_the_router_the_actors_and_their_servers(deployment):
    server_url = deployment.health()["replica-0"]["url"]
    assert deployment.stop() == 0, deployment.log_tail()
    assert "stopping 2 replica(s)" in deployment.log_path.read_text()
    for url in (deployment.url, server_url):
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{url}/health", timeout=5)
    for name in ("replica-0", "replica-1"):
        with pytest.raises(ValueError):
            replica(name)


def test_ray_serve_joins_the_cluster_with_the_auth_mode_ray_up_starts_it_with():
    """Issue 49: `make ray-up` starts the cluster with token authentication,
    and `make ray-serve` did not say so: Ray refused it (InvalidAuthToken)."""
    def recipe(target: str) -> str:
        return subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout
    up = next(line for line in recipe("ray-up").splitlines() if " start --head" in line)
    serve = next(line for line in recipe("ray-serve").splitlines() if "ray_replicas" in line)
    mode = up.split()[0]
    assert mode.startswith("RAY_AUTH_MODE=") and serve.split()[0] == mode
