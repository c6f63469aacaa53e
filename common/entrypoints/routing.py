"""Which replica serves a request (ch09, in progress): the router's policies.

A router in front of N engine replicas (each a chapter server on its own
port, or one of `--data-parallel-size` engines) picks one replica per
request. The policies here decide; they read only what the router knows
about each replica (`Replica`: healthy or not, and its load as its
`/stats` last said) and the request's prompt token ids. Sending the
request, timing out and retrying are the router's job, not theirs.

- `RoundRobinPolicy`: each healthy replica in turn.
- `LeastLoadedPolicy`: the replica with the fewest waiting requests, then
  the fewest running, then the emptiest KV cache.
- `PrefixAwarePolicy`: requests whose first full KV blocks are the same go
  to the same replica, where those blocks are already cached (chapter 04's
  prefix caching), so a shared system prompt or a conversation's earlier
  turns are not prefilled again elsewhere. The blocks are named in a
  chain as the engine names them (block j's name covers every token
  before it), but with blake2b digests: the engine's `compute_block_hash`
  uses Python's hash(), which differs from one process to the next (vLLM
  offers sha256 for that, `--prefix-caching-hash-algo`), and every router
  process must agree. A consistent-hash ring (`HashRing`) maps the name to
  a replica: a replica that joins or leaves moves only its own share of
  the prefixes, the others stay warm. A prompt shorter than one block has
  no prefix to keep: least loaded.

vLLM's production routers (vllm-router, llm-d's scheduler, Ray Serve
LLM's prefix-aware router) do the same kinds of things; llm-d scores every
replica by the prefix it holds, from the engines' KV events.

Left out: routing by the KV events themselves (what each replica really
holds), a load threshold above which prefix-aware falls back to least
loaded, session affinity by a header, weights per replica.
"""
from __future__ import annotations

import bisect
import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Protocol, Sequence



@dataclass
class ReplicaLoad:
    """A replica's load, as its `/stats` last said (the router polls it)."""
    num_waiting: int = 0
    num_running: int = 0
    kv_usage_perc: float = 0.0


@dataclass
class Replica:
    """One engine behind the router: a name (stable, the ring hashes it),
    where it answers, whether it does, and its last known load."""
    name: str
    url: str = ""
    healthy: bool = True
    load: ReplicaLoad = field(default_factory=ReplicaLoad)


class NoReplicaError(RuntimeError):
    """No healthy replica to send a request to (the router answers 503)."""


class RoutingPolicy(Protocol):
    def choose(self, prompt_token_ids: Sequence[int], replicas: Sequence[Replica]) -> Replica:
        """The replica for a request with this prompt."""
        ...


def healthy(replicas: Sequence[Replica]) -> list[Replica]:
    alive = [r for r in replicas if r.healthy]
    if not alive:
        raise NoReplicaError(f"none of the {len(replicas)} replicas is healthy")
    return alive


class RoundRobinPolicy:
    """Each healthy replica in turn."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, prompt_token_ids: Sequence[int], replicas: Sequence[Replica]) -> Replica:
        alive = healthy(replicas)
        return alive[next(self._turn) % len(alive)]


class LeastLoadedPolicy:
    """Fewest waiting requests, then fewest running, then the emptiest KV
    cache; ties go to the first replica listed."""

    def choose(self, prompt_token_ids: Sequence[int], replicas: Sequence[Replica]) -> Replica:
        return min(healthy(replicas), key=lambda r: (r.load.num_waiting, r.load.num_running,
                                                      r.load.kv_usage_perc))


def prefix_block_hashes(token_ids: Sequence[int], block_size: int,
                        max_blocks: int) -> list[int]:
    """The names of the prompt's first full blocks (at most `max_blocks`),
    chained as the engine's prefix cache chains them (block j's name
    depends on every token before it), the same in every process."""
    hashes: list[int] = []
    for j in range(min(len(token_ids) // block_size, max_blocks)):
        digest = hashlib.blake2b(digest_size=8)
        digest.update((hashes[-1] if hashes else 0).to_bytes(8, "big"))
        for token in token_ids[j * block_size:(j + 1) * block_size]:
            digest.update(int(token).to_bytes(4, "big"))
        hashes.append(int.from_bytes(digest.digest(), "big"))
    return hashes


def ring_point(text: str) -> int:
    """A point on the ring, the same in every process (Python's own hash()
    of a str changes from one process to the next)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing: each replica owns `points_per_replica` points on a
    ring of 2**64; a key belongs to the first point at or after its own
    (clockwise), skipping replicas that are down. Adding a replica takes
    keys only from the others' arcs it lands on; removing one gives only
    its keys to its neighbours."""

    def __init__(self, names: Sequence[str] = (), points_per_replica: int = 100):
        self.points_per_replica = points_per_replica
        self._points: list[int] = []  # sorted
        self._owner: dict[int, str] = {}
        for name in names:
            self.add(name)

    def add(self, name: str) -> None:
        for i in range(self.points_per_replica):
            point = ring_point(f"{name}#{i}")
            if point not in self._owner:
                bisect.insort(self._points, point)
                self._owner[point] = name

    def remove(self, name: str) -> None:
        self._points = [p for p in self._points if self._owner[p] != name]
        self._owner = {p: n for p, n in self._owner.items() if n != name}

    def names(self) -> set[str]:
        return set(self._owner.values())

    def owner(self, key: int, usable: set[str] | None = None) -> str:
        """The replica that owns `key`: the first usable one clockwise."""
        if not self._points:
            raise NoReplicaError("the ring is empty")
        start = bisect.bisect_left(self._points, ring_point(str(key)))
        for step in range(len(self._points)):
            name = self._owner[self._points[(start + step) % len(self._points)]]
            if usable is None or name in usable:
                return name
        raise NoReplicaError("no usable replica on the ring")


class PrefixAwarePolicy:
    """The same first blocks, the same replica (consistent hashing over the
    prompt's first `prefix_blocks` full blocks); shorter prompts: least
    loaded. `block_size` should be the engines' (16, vLLM's default)."""

    def __init__(self, block_size: int = 16, prefix_blocks: int = 4,
                 points_per_replica: int = 100):
        self.block_size = block_size
        self.prefix_blocks = prefix_blocks
        self.ring = HashRing(points_per_replica=points_per_replica)
        self.fallback = LeastLoadedPolicy()

    def choose(self, prompt_token_ids: Sequence[int], replicas: Sequence[Replica]) -> Replica:
        alive = healthy(replicas)
        self._follow(replicas)
        hashes = prefix_block_hashes(prompt_token_ids, self.block_size, self.prefix_blocks)
        if not hashes:
            return self.fallback.choose(prompt_token_ids, alive)
        by_name = {r.name: r for r in alive}
        return by_name[self.ring.owner(hashes[-1], set(by_name))]

    def _follow(self, replicas: Sequence[Replica]) -> None:
        """Keep the ring's members those the router lists (up or down: a
        replica down for a while keeps its points, and its prefixes come
        back to it when it does)."""
        listed = {r.name for r in replicas}
        for name in self.ring.names() - listed:
            self.ring.remove(name)
        for name in listed - self.ring.names():
            self.ring.add(name)
