"""Measure the answers of exercise 09's "Predict, then measure" (solutions.md).

    .venv/bin/python 09-scale-out/exercises/measure.py

With the course's policies (common/entrypoints/routing.py) and fake
engines, no model and no server: a second on any machine, and the same
figures on every one (seeded workloads, no clock).

1. a fifth replica joins four: the share of 10,000 prefixes that move,
   on the ring and with `key % N` (the obvious way to pick a replica);
2. points per replica: the largest and smallest share of 10,000 prefixes
   over 4 replicas, with 1, 10, 100 and 1000 points each;
3. the cache: 64 conversations of 6 turns through the router's choice,
   into 4 fake engines that keep every full block they computed (chapter
   04's prefix cache, no eviction): the prefix-cache hit rate, the
   requests per replica and the blocks held in all, for round robin and
   prefix-aware;
4. a long shared system prompt (5 blocks) with `--prefix-blocks` 4 and 8;
5. short first messages: conversations whose first prompt has fewer full
   blocks than `--prefix-blocks`, and how many of them change replica.

Writes `results/measured-DATE.json` beside this file. Left out: least
loaded (it reads each replica's queue from /stats, which a workload sent
one request at a time never fills), evictions, and time (TTFT, tok/s:
`make bench-scale` measures those on real engines).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from common.entrypoints.routing import (  # noqa: E402
    HashRing,
    PrefixAwarePolicy,
    Replica,
    RoundRobinPolicy,
    prefix_block_hashes,
)

COMMAND = "python 09-scale-out/exercises/measure.py"
BLOCK = 16
VOCAB = 49152


def tokens(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(length)]


def prefix_keys(n: int) -> list[int]:
    """n prefixes' keys: the name of the 4th block of n random prompts."""
    rng = random.Random(1)
    return [prefix_block_hashes(tokens(rng, 4 * BLOCK), BLOCK, 4)[-1] for _ in range(n)]


def joining(keys: list[int]) -> dict:
    """Q1: 4 replicas, then 5: the share of keys that change owner."""
    four, five = [f"engine-{i}" for i in range(4)], [f"engine-{i}" for i in range(5)]
    ring = HashRing(four)
    before = [ring.owner(k) for k in keys]
    ring.add("engine-4")
    after = [ring.owner(k) for k in keys]
    moved = [b != a for b, a in zip(before, after)]
    modulo_moved = [four[k % 4] != five[k % 5] for k in keys]
    return {"prefixes": len(keys), "ring_moved_share": round(sum(moved) / len(keys), 4),
            "ring_moved_to_newcomer": sum(a == "engine-4" for a, m in zip(after, moved) if m),
            "ring_moved": sum(moved),
            "modulo_moved_share": round(sum(modulo_moved) / len(keys), 4)}


def balance(keys: list[int]) -> list[dict]:
    """Q2: each replica's share of the keys, by points per replica."""
    rows = []
    for points in (1, 10, 100, 1000):
        ring = HashRing([f"engine-{i}" for i in range(4)], points_per_replica=points)
        counts = Counter(ring.owner(k) for k in keys)
        shares = sorted(counts.get(f"engine-{i}", 0) / len(keys) for i in range(4))
        rows.append({"points_per_replica": points, "smallest_share": round(shares[0], 4),
                     "largest_share": round(shares[-1], 4),
                     "largest_over_fair": round(shares[-1] / 0.25, 2)})
    return rows


def conversations(n: int, turns: int, system_blocks: int, first_tokens: tuple[int, int],
                  seed: int) -> list[list[list[int]]]:
    """Each conversation's prompts: a system prompt shared by all, a first
    message, then an answer and a new message per turn (the whole history
    is the next prompt)."""
    rng = random.Random(seed)
    system = tokens(rng, system_blocks * BLOCK)
    found = []
    for _ in range(n):
        prompt = system + tokens(rng, rng.randrange(*first_tokens))
        prompts = [prompt]
        for _ in range(turns - 1):
            prompt = prompt + tokens(rng, rng.randrange(60, 140))
            prompts.append(prompt)
        found.append(prompts)
    return found


class FakeEngine:
    """Chapter 04's prefix cache without eviction: a full block is found if
    the same tokens, from the prompt's start to its end, were computed here."""

    def __init__(self) -> None:
        self.cached: set[tuple[int, ...]] = set()
        self.requests = 0

    def serve(self, prompt: list[int]) -> tuple[int, int]:
        """(full blocks of the prompt, how many were found cached)."""
        self.requests += 1
        full = len(prompt) // BLOCK
        hit = 0
        while hit < full and tuple(prompt[:(hit + 1) * BLOCK]) in self.cached:
            hit += 1
        self.cached.update(tuple(prompt[:(j + 1) * BLOCK]) for j in range(full))
        return full, hit


def through(policy, workload: list[list[list[int]]], n_replicas: int = 4) -> dict:
    """The workload's turns, each round in a shuffled order, through the
    policy into fake engines."""
    pool = [Replica(f"engine-{i}") for i in range(n_replicas)]
    engines = {r.name: FakeEngine() for r in pool}
    rng = random.Random(7)
    queried = hits = 0
    homes: dict[int, set[str]] = {c: set() for c in range(len(workload))}
    for turn in range(len(workload[0])):
        order = list(range(len(workload)))
        rng.shuffle(order)
        for c in order:
            name = policy.choose(workload[c][turn], pool).name
            homes[c].add(name)
            full, hit = engines[name].serve(workload[c][turn])
            queried, hits = queried + full, hits + hit
    requests = sorted(e.requests for e in engines.values())
    return {"hit_rate": round(hits / queried, 4), "queried_blocks": queried,
            "hit_blocks": hits, "requests_per_replica": requests,
            "blocks_held": sum(len(e.cached) for e in engines.values()),
            "conversations_that_moved": sum(len(h) > 1 for h in homes.values())}


def cache(args) -> dict:
    """Q3: a 2-block system prompt, first messages of 4 blocks or more."""
    workload = conversations(64, 6, 2, (40, 100), seed=3)
    return {"workload": "64 conversations x 6 turns, a 2-block system prompt",
            "round_robin": through(RoundRobinPolicy(), workload),
            "prefix_aware": through(PrefixAwarePolicy(BLOCK, 4), workload)}


def long_system_prompt(args) -> dict:
    """Q4: a 5-block system prompt shared by every conversation."""
    workload = conversations(64, 6, 5, (40, 100), seed=4)
    return {"workload": "64 conversations x 6 turns, a 5-block system prompt",
            "round_robin": through(RoundRobinPolicy(), workload),
            "prefix_aware_4_blocks": through(PrefixAwarePolicy(BLOCK, 4), workload),
            "prefix_aware_8_blocks": through(PrefixAwarePolicy(BLOCK, 8), workload)}


def short_first_messages(args) -> dict:
    """Q5: the first prompt has 2 or 3 full blocks (a 1-block system prompt
    and a first message of 20 to 40 tokens)."""
    workload = conversations(64, 6, 1, (20, 40), seed=5)
    return {"workload": "64 conversations x 6 turns, 1-block system prompt, first "
                        "messages of 20 to 40 tokens",
            "prefix_aware": through(PrefixAwarePolicy(BLOCK, 4), workload),
            "prefix_aware_2_blocks": through(PrefixAwarePolicy(BLOCK, 2), workload)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path,
                   default=HERE / "results" / f"measured-{datetime.date.today()}.json")
    args = p.parse_args(argv)
    keys = prefix_keys(10_000)
    record = {"command": COMMAND,
              "machine": {"python": platform.python_version(),
                          "date": datetime.date.today().isoformat()},
              "joining": joining(keys), "balance": balance(keys), "cache": cache(args),
              "long_system_prompt": long_system_prompt(args),
              "short_first_messages": short_first_messages(args)}
    text = json.dumps(record, indent=1)
    print(text)
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(text + "\n")
    print(f"wrote {args.out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
