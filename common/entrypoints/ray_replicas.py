"""Replicas on a Ray cluster (ch09): one Ray actor per chapter server, the router in front.

    make ray-up       # ray start --head --port 6379 --num-cpus 2 ...
    python -m common.entrypoints.ray_replicas --address auto --replicas 2 --chapter 09 \\
        --router-port 8100 --dtype float32 --device-memory-gb 1.1     # make ray-serve
    make ray-down     # ray stop

The flags this module does not know are the servers' (`--dtype`, the card,
`--engine-core`, ...). Each replica is a `ServerReplica` actor (`num_cpus=1`)
that starts `NN-*/server.py` on a free port of its node as a child process,
waits until it answers /health, and reports its URL (the node's IP and the
port). The actors are placed with Ray's SPREAD strategy: on a cluster of
several machines they land on different ones. The driver (this process)
then serves the chapter's router (router.py) in front of their URLs, until
Ctrl-C or SIGTERM stops it, the replicas and their servers.

When a replica fails:
- its server dies: the router's poller marks it down, the others take the traffic;
- its actor dies (`ray.kill`, its node lost): Ray kills a dead worker's child
  processes (`RAY_kill_child_processes_on_worker_exit`, on by default), so the
  server goes with it and the router marks it down. Ray restarts the actor up
  to `--max-restarts` times, on any node with a free CPU: a new server, a new
  URL. The driver follows each actor (`follow`), hands the new URL to the
  router, whose poller sees it answer /stats and gives it traffic again. An
  actor dead for good (`ActorDiedError`) stays down;
- this process dies (even `kill -9`): Ray ends its job's actors, and their
  servers with them.

A second machine joins with `ray start --address=<head-ip>:6379`, the
address `ray start --head` prints (Ray advertises the head's own address,
even for `--node-ip-address 127.0.0.1`), with the head's token
(`ray get-auth-token` there; RAY_AUTH_TOKEN=... here). It needs the course at
the same path, `make setup` done: the actor starts the server found there.
Nothing in the course's code changes.

Left out: Ray Serve (its deployments, autoscaling, its proxy in place of our
router), GPUs per actor (`num_gpus=1`: one engine per GPU), placement groups
(a tensor-parallel replica's ranks on one node), shipping the code to the
nodes (`runtime_env`). A replica's `--api-key` is the router's too: it
guards the router and the router polls with it.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray
import requests
from fastapi import FastAPI
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, ActorUnavailableError

from common.entrypoints.launcher import make_server
from common.entrypoints.router import POLICIES, Router, build_router_app, tokenizer_prompt_ids
from common.entrypoints.routing import Replica
from common.net import free_port

log = logging.getLogger("ray-replicas")

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "llm-course"  # ray.get_actor("replica-0", namespace=NAMESPACE) finds a replica


def server_script(chapter: str) -> Path:
    """"09" -> ROOT/09-scale-out/server.py"""
    found = sorted(ROOT.glob(f"{int(chapter):02d}-*/server.py"))
    if not found:
        raise ValueError(f"no chapter {chapter} under {ROOT}")
    return found[0]


@ray.remote(num_cpus=1)
class ServerReplica:
    """One chapter server, a child process of this actor, on a free port of
    the actor's node; its output goes to a log file on that node."""

    def __init__(self, chapter: str, server_args: list[str], startup_timeout_s: float = 300.0):
        host = ray.util.get_node_ip_address()
        port = free_port(host)
        self.server_url = f"http://{host}:{port}"
        name = ray.get_runtime_context().get_actor_name()
        self.log_path = Path(tempfile.gettempdir()) / f"ray-{name}-{port}.log"
        command = [sys.executable, str(server_script(chapter)),
                   "--host", host, "--port", str(port), *server_args]
        with open(self.log_path, "w") as log_file:  # the child keeps its own copy
            self.process = subprocess.Popen(command, stdout=log_file,
                                            stderr=subprocess.STDOUT, cwd=ROOT)
        self.wait_until_healthy(startup_timeout_s)

    def wait_until_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited at startup (status "
                                   f"{self.process.returncode}); {self.log_path}:\n"
                                   + self.log_tail())
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the server did not answer /health in {timeout_s:.0f} s")
            time.sleep(0.5)

    def url(self) -> str:
        return self.server_url

    def node_id(self) -> str:
        """The Ray node (machine) this replica runs on."""
        return ray.get_runtime_context().get_node_id()

    def log_file(self) -> str:
        return f"{ray.util.get_node_ip_address()}:{self.log_path}"

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def healthy(self) -> bool:
        """The server runs and answers /health with 200."""
        if self.process.poll() is not None:
            return False
        try:
            return requests.get(f"{self.server_url}/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def stop(self) -> int:
        """SIGTERM (the server finishes its requests, stops its engine), then
        SIGKILL if it is still there after 30 s; its exit status."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def start_replicas(count: int, chapter: str, server_args: list[str],
                   max_restarts: int) -> list[ActorHandle]:
    """`count` named actors, spread over the nodes; each starts its server."""
    return [ServerReplica.options(name=f"replica-{i}", namespace=NAMESPACE,
                                  scheduling_strategy="SPREAD",
                                  max_restarts=max_restarts).remote(chapter, server_args)
            for i in range(count)]


def stop_replicas(actors: list[ActorHandle]) -> None:
    """Each server stopped gracefully (40 s at most in all), then its actor."""
    if not actors:
        return
    stopping = [actor.stop.remote() for actor in actors]
    ray.wait(stopping, num_returns=len(stopping), timeout=40)
    for actor in actors:
        ray.kill(actor)


def log_placement(actors: list[ActorHandle], urls: list[str]) -> None:
    nodes = ray.get([actor.node_id.remote() for actor in actors])
    log_files = ray.get([actor.log_file.remote() for actor in actors])
    for i, (url, node, log_file) in enumerate(zip(urls, nodes, log_files)):
        log.info("replica-%d: %s on node %s, its log in %s", i, url, node[:8], log_file)


async def follow(actor: ActorHandle, replica: Replica, every_s: float = 1.0) -> None:
    """Give the router a restarted actor's new URL; return once the actor is
    dead for good. While Ray restarts it, `url()` waits for the new server."""
    while True:
        try:
            url = await actor.url.remote()
        except ActorDiedError:
            log.warning("%s is dead for good: the router keeps it down", replica.name)
            return
        except ActorUnavailableError:  # restarting: ask the new actor
            url = replica.url
        if url != replica.url:
            log.info("%s was restarted by Ray: now at %s", replica.name, url)
            replica.url = url  # the poller marks it up once it answers /stats
        await asyncio.sleep(every_s)


def follow_restarts(app: FastAPI, actors: list[ActorHandle], replicas: list[Replica]) -> None:
    """Run `follow` for each replica while the router serves."""
    router_lifespan = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with router_lifespan(app):
            followers = [asyncio.create_task(follow(a, r)) for a, r in zip(actors, replicas)]
            yield
            for task in followers:
                task.cancel()

    app.router.lifespan_context = lifespan


def serve_router(args: argparse.Namespace, actors: list[ActorHandle], urls: list[str],
                 server_args: list[str]) -> None:
    """The chapter's router in front of the replicas, until Ctrl-C or SIGTERM.
    It reads `--model`, `--block-size` and `--api-key` from the servers' flags."""
    servers = argparse.ArgumentParser(add_help=False)
    servers.add_argument("--model", default="smollm2")
    servers.add_argument("--block-size", type=int, default=16)
    servers.add_argument("--api-key", default=None)
    flags = servers.parse_known_args(server_args)[0]
    replicas = [Replica(f"replica-{i}", url) for i, url in enumerate(urls)]
    router = Router(replicas, POLICIES[args.policy](flags.block_size, args.prefix_blocks),
                    tokenizer_prompt_ids(flags.model), poll_interval_s=args.poll_interval_s,
                    api_key=flags.api_key)
    app = build_router_app(router)
    follow_restarts(app, actors, replicas)
    log.info("routing %s over %s on http://%s:%d/v1", args.policy, ", ".join(urls),
             args.router_host, args.router_port)
    make_server(app, args.router_host, args.router_port, log_level="warning").run()


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Other flags go to each replica's server.")
    parser.add_argument("--address", default="auto",
                        help="the Ray cluster (auto: the one `ray start` runs on this machine)")
    parser.add_argument("--replicas", type=int, default=2, help="how many servers (actors)")
    parser.add_argument("--chapter", default="09", help="whose server.py each replica runs")
    parser.add_argument("--max-restarts", type=int, default=1,
                        help="how many times Ray restarts a replica's actor when it dies")
    parser.add_argument("--policy", choices=list(POLICIES), default="prefix-aware")
    parser.add_argument("--prefix-blocks", type=int, default=4,
                        help="prefix-aware: how many first blocks name a prefix")
    parser.add_argument("--poll-interval-s", type=float, default=0.5,
                        help="how often the router reads each replica's /stats")
    parser.add_argument("--router-host", default="127.0.0.1")
    parser.add_argument("--router-port", type=int, default=8100)
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, server_args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per /stats poll
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops us as Ctrl-C does
    try:
        ray.init(address=args.address, namespace=NAMESPACE, logging_level=logging.WARNING)
    except ConnectionError as exc:
        log.error("cannot join the Ray cluster at --address %s: %s. Is it up (`make ray-up`), "
                  "and is its token here (~/.ray/auth_token)?", args.address, exc)
        return 1
    log.info("Ray cluster: %d node(s), %g CPUs", len(ray.nodes()),
             ray.cluster_resources().get("CPU", 0))
    actors: list[ActorHandle] = []
    try:
        actors = start_replicas(args.replicas, args.chapter, server_args, args.max_restarts)
        urls = ray.get([actor.url.remote() for actor in actors])  # each answers /health
        log_placement(actors, urls)
        serve_router(args, actors, urls, server_args)
    except KeyboardInterrupt:
        pass
    finally:
        log.info("stopping %d replica(s)", len(actors))
        stop_replicas(actors)
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
