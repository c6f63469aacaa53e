"""Exercise 09's grading tests: the router's prefix-aware policy
(`make exercise CH=09`; the reference is `prefix_block_hashes`, `HashRing`
and `PrefixAwarePolicy` in common/entrypoints/routing.py).

Fake replicas only: `Replica` objects with a name and a load and, for the
last two tests, fake engines behind the course's real `Router`, reached
through httpx's MockTransport, each keeping a prefix cache of full blocks
as chapter 04's block manager does. No model, no server, no clock.

Each test is built to catch a mistake learners make: the partial last
block named, blocks named alone instead of chained, Python's hash() (not
the same in two processes), one point per replica (one replica takes
most of the load), keys past the last point not wrapped round, a down
replica's keys dealt out anew (everyone's cache goes cold), the key taken
from the whole prompt (a conversation moves at every turn) or from its
first block alone (a shared system prompt sends everyone to one place), a
down replica chosen anyway, a short prompt sent anywhere but to the least
loaded healthy replica.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest
from starlette.requests import Request

from common.entrypoints.router import Router
from common.entrypoints.routing import (
    NoReplicaError,
    Replica,
    ReplicaLoad,
    RoundRobinPolicy,
    ring_point,
)

pytestmark = [pytest.mark.ch09, pytest.mark.ex09]

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16  # the engines' block size
PREFIX_BLOCKS = 4  # the router's default --prefix-blocks


def replicas(n: int) -> list[Replica]:
    return [Replica(f"engine-{i}", f"http://engine-{i}") for i in range(n)]


def tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 49152) for _ in range(length)]


def is_one_of(chosen: Replica, pool: list[Replica]) -> bool:
    return any(chosen is r for r in pool)


def module_of(impl):
    """The module under test: your exercise file, or the reference."""
    return sys.modules[impl.PrefixAwarePolicy.__module__]


def no_replica_error(impl) -> type[Exception]:
    """The NoReplicaError the file under test raises: the course's, which
    the exercise imports (a planted bug's copy of the reference has its own)."""
    return getattr(module_of(impl), "NoReplicaError", NoReplicaError)


# ------------------------------------------------------- 1. naming blocks
def test_block_names_cover_full_blocks_only(impl):
    """One name per full block, the first `max_blocks` of them: the tokens
    after the last full block are not a block yet and change nothing."""
    ids = tokens(1, 3 * BLOCK + 5)
    names = impl.prefix_block_hashes(ids, BLOCK, 10)
    assert isinstance(names, list) and all(isinstance(n, int) for n in names), \
        f"a list of ints, got {names!r}"
    assert len(names) == 3, f"53 tokens hold 3 full blocks of 16 (5 tokens left over), " \
        f"got {len(names)} names"
    assert len(set(names)) == 3, "three different blocks, three different names"
    assert impl.prefix_block_hashes(ids, BLOCK, 2) == names[:2], \
        "at most max_blocks names: the first ones"
    assert impl.prefix_block_hashes(ids[:3 * BLOCK], BLOCK, 10) == names, \
        "the 5 tokens after the last full block must not change any name"
    assert impl.prefix_block_hashes(ids[:BLOCK], BLOCK, 4) == names[:1], \
        "exactly one block of 16 tokens: one name"
    assert impl.prefix_block_hashes(ids[:BLOCK - 1], BLOCK, 4) == [], \
        "15 tokens are not a full block: no name"
    assert impl.prefix_block_hashes([], BLOCK, 4) == []
    assert len(impl.prefix_block_hashes(ids, 8, 10)) == 6, "blocks of 8: 6 full ones in 53"


def test_each_block_name_depends_on_every_token_before_it(impl):
    """Block j's name covers blocks 0..j (chained, as the engine's prefix
    cache names blocks) and nothing after block j."""
    ids = tokens(2, 4 * BLOCK)
    names = impl.prefix_block_hashes(ids, BLOCK, 4)
    for j in range(4):
        changed = list(ids)
        changed[j * BLOCK + 7] += 1  # one token of block j
        again = impl.prefix_block_hashes(changed, BLOCK, 4)
        assert again[:j] == names[:j], \
            f"a token of block {j} changed the name of an earlier block"
        for k in range(j, 4):
            assert again[k] != names[k], (
                f"a token of block {j} changed, and block {k}'s name did not: block {k}'s "
                "name must depend on every token before its end (chain each name on the "
                "previous one)")
    swapped = list(ids)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    assert impl.prefix_block_hashes(swapped, BLOCK, 1) != names[:1], \
        "two tokens swapped inside a block: another block, another name (order matters)"
    block = ids[:BLOCK]
    first, second = impl.prefix_block_hashes(block + block, BLOCK, 2)
    assert first != second, "the same 16 tokens at block 0 and at block 1 are two " \
        "different prefixes: two names"
    after_a = impl.prefix_block_hashes(tokens(3, BLOCK) + block, BLOCK, 2)[1]
    after_b = impl.prefix_block_hashes(tokens(4, BLOCK) + block, BLOCK, 2)[1]
    assert after_a != after_b, "the same block after two different first blocks: two names"


PROBE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("routing_under_test", sys.argv[1])
routing = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = routing
spec.loader.exec_module(routing)
prompts = json.loads(sys.stdin.read())
if sys.argv[2] == "names":
    print(json.dumps([routing.prefix_block_hashes(ids, 16, 4) for ids in prompts]))
else:
    policy = routing.PrefixAwarePolicy(block_size=16, prefix_blocks=4)
    pool = [routing.Replica(f"engine-{i}") for i in range(4)]
    print(json.dumps([policy.choose(ids, pool).name for ids in prompts]))
"""


def in_another_process(impl, what: str, prompts: list[list[int]], hash_seed: str) -> list:
    """PROBE in a fresh interpreter, on the file under test (yours or the
    reference), with PYTHONHASHSEED set: what another router would compute."""
    source = module_of(impl).__file__
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", PROBE, source, what], input=json.dumps(prompts),
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    if "NotImplementedError" in run.stderr:
        raise NotImplementedError(run.stderr.strip().splitlines()[-1])
    assert run.returncode == 0, f"the other process failed:\n{run.stderr}"
    return json.loads(run.stdout)


def test_block_names_are_the_same_in_every_process(impl):
    """Two routers, or one restarted, must name a prompt's blocks alike:
    Python's hash() of a str, of bytes or of None is not the same from one
    process to the next."""
    prompts = [tokens(seed, 4 * BLOCK + seed) for seed in range(6)]
    here = [impl.prefix_block_hashes(ids, BLOCK, PREFIX_BLOCKS) for ids in prompts]
    for seed in ("1", "2"):
        assert in_another_process(impl, "names", prompts, seed) == here, (
            f"another Python process (PYTHONHASHSEED={seed}) names the same blocks "
            "differently: the router's names must not depend on Python's hash()")


# ------------------------------------------------------------- 2. the ring
def ring_order(names: list[str], points_per_replica: int) -> list[tuple[int, str]]:
    """Every replica's points, sorted: what the ring's docstring says."""
    return sorted((ring_point(f"{name}#{i}"), name) for name in names
                  for i in range(points_per_replica))


def clockwise_owner(points: list[tuple[int, str]], key: int, usable=None) -> str:
    at = ring_point(str(key))
    order = [n for p, n in points if p >= at] + [n for p, n in points if p < at]
    return next(n for n in order if usable is None or n in usable)


def test_a_key_belongs_to_the_first_point_clockwise(impl):
    """The owner of a key is the replica of the first point at or after the
    key's point, wrapping from the largest point to the smallest."""
    names = ["a", "b", "c"]
    ring = impl.HashRing(names, points_per_replica=3)
    assert ring.names() == set(names)
    points = ring_order(names, 3)
    keys = range(3000)
    past_last = [k for k in keys if ring_point(str(k)) > points[-1][0]]
    assert past_last, "the test needs keys past the last point"
    wrong = [k for k in keys if ring.owner(k) != clockwise_owner(points, k)]
    if wrong:
        k = wrong[0]
        where = ("past the last point: wrap round to the first point's replica"
                 if k in past_last else "the first point at or after the key's")
        pytest.fail(f"{len(wrong)} of {len(keys)} keys go elsewhere; key {k} went to "
                    f"{ring.owner(k)!r}, not {clockwise_owner(points, k)!r} ({where}; the "
                    "points are ring_point(f'{name}#{i}'), the key's ring_point(str(key)))")
    with pytest.raises(no_replica_error(impl)):
        impl.HashRing().owner(7)


def test_the_ring_skips_replicas_that_are_not_usable(impl):
    """With `usable`, the owner is the first point clockwise whose replica
    is usable: a down replica's keys go to the next replica round the
    ring, and everyone else keeps theirs."""
    names = ["a", "b", "c", "d"]
    ring = impl.HashRing(names, points_per_replica=20)
    points = ring_order(names, 20)
    keys = range(2000)
    for usable in ({"a", "b", "c", "d"}, {"a", "c", "d"}, {"a", "d"}, {"b"}):
        wrong = [k for k in keys if ring.owner(k, usable) != clockwise_owner(points, k, usable)]
        assert not wrong, (
            f"usable {sorted(usable)}: {len(wrong)} of {len(keys)} keys go elsewhere; key "
            f"{wrong[0]} went to {ring.owner(wrong[0], usable)!r}, the next usable point "
            f"clockwise is {clockwise_owner(points, wrong[0], usable)!r}'s")
    for usable in (set(), {"zz"}):
        with pytest.raises(no_replica_error(impl)):
            ring.owner(5, usable)


def test_adding_a_replica_moves_keys_only_to_it_and_removing_it_moves_them_back(impl):
    """Consistent hashing: a replica that joins takes keys for itself only,
    about its share; one that leaves gives back only its own keys."""
    ring = impl.HashRing(["a", "b", "c", "d"])
    keys = range(3000)
    before = {k: ring.owner(k) for k in keys}
    ring.add("e")
    assert ring.names() == {"a", "b", "c", "d", "e"}
    after = {k: ring.owner(k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "e" for k in moved), \
        "a replica that joins takes keys for itself only: no key moves between the others"
    assert 0.1 < len(moved) / len(keys) < 0.3, \
        f"{len(moved)} of {len(keys)} keys moved to the fifth replica: about 1/5 should"
    ring.remove("e")
    assert ring.names() == {"a", "b", "c", "d"}
    assert {k: ring.owner(k) for k in keys} == before, \
        "removed again, its keys go back to their previous owners"
    ring.remove("b")
    without_b = {k: ring.owner(k) for k in keys}
    assert "b" not in without_b.values(), "a removed replica owns nothing"
    assert all(without_b[k] == before[k] for k in keys if before[k] != "b"), \
        "a replica that leaves moves only its own keys"
    ring.add("b")
    assert {k: ring.owner(k) for k in keys} == before, \
        "the ring depends on who is on it, not on the order they joined in"


# ------------------------------------------------------------ 3. the policy
def test_a_conversation_stays_on_one_replica_turn_after_turn(impl):
    """Turn after turn the prompt grows; its first blocks stay the same, so
    its replica does, where those blocks are cached."""
    pool = replicas(4)
    policy = impl.PrefixAwarePolicy(block_size=BLOCK, prefix_blocks=PREFIX_BLOCKS)
    for seed in range(20):
        history = tokens(seed, 5 * BLOCK + 3)
        first = policy.choose(history, pool)
        assert is_one_of(first, pool), "choose returns one of the replicas it was given"
        for turn in range(4):
            history = history + tokens(1000 * seed + turn, 40)
            assert policy.choose(history, pool).name == first.name, (
                f"conversation {seed} moved at turn {turn + 2}: the key must come from the "
                f"first {PREFIX_BLOCKS} full blocks, which every turn shares")


def test_prompts_that_differ_within_the_prefix_blocks_spread(impl):
    """The last of the first `prefix_blocks` blocks is the key: prompts that
    share a first block (a short system prompt) but differ before the end
    of block 3 spread; prompts that share all four go to one replica."""
    pool = replicas(4)
    policy = impl.PrefixAwarePolicy(block_size=BLOCK, prefix_blocks=PREFIX_BLOCKS)
    system = tokens(5, BLOCK)
    counts = Counter(policy.choose(system + tokens(seed, 3 * BLOCK + 20), pool).name
                     for seed in range(400))
    assert len(counts) == 4 and min(counts.values()) > 400 / 4 * 0.5, (
        f"400 prompts that share only their first block: {dict(counts)}; a replica per "
        "first block would send a whole system prompt's traffic to one replica")
    shared = tokens(6, PREFIX_BLOCKS * BLOCK)
    same = {policy.choose(shared + tokens(seed, 50), pool).name for seed in range(50)}
    assert len(same) == 1, f"50 prompts with the same first {PREFIX_BLOCKS} blocks went to " \
        f"{sorted(same)}: one replica holds those blocks"


def test_different_conversations_spread_over_every_replica(impl):
    """2000 different conversations over 4 replicas: each gets close to a
    quarter (100 points per replica average the arcs out)."""
    pool = replicas(4)
    policy = impl.PrefixAwarePolicy(block_size=BLOCK)
    counts = Counter(policy.choose(tokens(seed, 5 * BLOCK), pool).name for seed in range(2000))
    fair = 2000 / 4
    assert len(counts) == 4 and fair * 0.7 < min(counts.values()) \
        and max(counts.values()) < fair * 1.3, (
            f"2000 conversations over 4 replicas: {dict(counts)}; with 100 points per "
            "replica each gets about 500 (one point each leaves arcs of any length)")


def owners(policy, pool: list[Replica], n: int = 1500) -> dict[int, str]:
    return {seed: policy.choose(tokens(seed, 5 * BLOCK), pool).name for seed in range(n)}


def test_a_joining_replica_takes_only_its_share(impl):
    """A fifth replica joins: about a fifth of the prefixes move, all of
    them to it; the others stay warm. It leaves: they come back."""
    pool = replicas(4)
    policy = impl.PrefixAwarePolicy(block_size=BLOCK)
    before = owners(policy, pool)
    after = owners(policy, pool + [Replica("engine-4", "http://engine-4")])
    moved = [seed for seed in before if before[seed] != after[seed]]
    assert all(after[seed] == "engine-4" for seed in moved), \
        "a prefix moved between two replicas that were there before: only the newcomer takes"
    assert 0.1 < len(moved) / len(before) < 0.3, \
        f"{len(moved)} of {len(before)} prefixes moved: about 1/5 should"
    assert owners(policy, pool) == before, "the newcomer left: its prefixes go back"


def test_a_down_replica_moves_only_its_prefixes_and_gets_them_back(impl):
    """A replica goes down: only its prefixes move, to where they would go
    if it were removed; back up, they return to it."""
    pool = replicas(4)
    policy = impl.PrefixAwarePolicy(block_size=BLOCK)
    before = owners(policy, pool)
    pool[2].healthy = False
    down = owners(policy, pool)
    assert "engine-2" not in down.values(), "a replica that is down gets no request"
    stayed = [seed for seed, name in before.items() if name != "engine-2"]
    moved = [seed for seed in stayed if down[seed] != before[seed]]
    assert not moved, f"{len(moved)} prefixes of healthy replicas moved when engine-2 went " \
        "down: only engine-2's may move (to the next replica round the ring)"
    pool[2].healthy = True
    assert owners(policy, pool) == before, "back up: its prefixes come back to it"
    gone = owners(policy, [r for r in pool if r.name != "engine-2"])
    assert gone == down, "engine-2 removed for good: its prefixes go where they went " \
        "while it was down (the next replica clockwise), not anywhere else"


def test_a_prompt_shorter_than_a_block_goes_to_the_least_loaded_healthy_replica(impl):
    """No full block, no prefix to keep: the least loaded healthy replica.
    One full block is a prefix: the ring decides."""
    pool = replicas(3)
    for replica, waiting in zip(pool, (5, 1, 3)):
        replica.load = ReplicaLoad(num_waiting=waiting)
    policy = impl.PrefixAwarePolicy(block_size=BLOCK)
    for short in ([1, 2, 3], list(range(BLOCK - 1)), []):
        chosen = policy.choose(short, pool)
        assert is_one_of(chosen, pool) and chosen.name == "engine-1", \
            f"a prompt of {len(short)} tokens has no full block: the least loaded replica"
    pool[1].healthy = False
    assert policy.choose([1, 2, 3], pool).name == "engine-2", \
        "the least loaded replica that is healthy"
    pool[1].healthy = True
    one_block = tokens(8, BLOCK)
    chosen = policy.choose(one_block, pool).name
    for replica in pool:
        replica.load = ReplicaLoad(num_waiting=9 if replica.name == chosen else 0)
    assert policy.choose(one_block, pool).name == chosen, \
        "a prompt of exactly one block has a prefix: the ring decides, not the load"


def test_no_healthy_replica_is_an_error(impl):
    """Every replica down, or none listed: NoReplicaError (the router
    answers 503), never a guess."""
    pool = replicas(2)
    for replica in pool:
        replica.healthy = False
    policy = impl.PrefixAwarePolicy(block_size=BLOCK)
    for prompt in (tokens(9, 5 * BLOCK), [1, 2, 3]):
        with pytest.raises(no_replica_error(impl)):
            policy.choose(prompt, pool)
    with pytest.raises(no_replica_error(impl)):
        policy.choose(tokens(9, 5 * BLOCK), [])


def test_the_policy_routes_alike_in_every_process(impl):
    """Two routers in front of the same replicas send a conversation to the
    same one: the ring's points and the keys do not depend on the process."""
    prompts = [tokens(seed, 5 * BLOCK) for seed in range(40)]
    pool = replicas(4)
    policy = impl.PrefixAwarePolicy(block_size=BLOCK, prefix_blocks=PREFIX_BLOCKS)
    here = [policy.choose(ids, pool).name for ids in prompts]
    for seed in ("1", "2"):
        assert in_another_process(impl, "policy", prompts, seed) == here, (
            f"another router (PYTHONHASHSEED={seed}) sends the same prompts elsewhere: "
            "neither the ring nor the block names may depend on Python's hash()")


# ----------------------------------------- 4. your policy in the real router
class FakeEngine:
    """A replica as the router sees it: answers /v1/completions and keeps a
    prefix cache as chapter 04's block manager does (a full block is found
    if the same tokens, from the prompt's start to the block's end, were
    computed here before; no eviction). Or fails with a 500."""

    def __init__(self, name: str):
        self.name = name
        self.cached: set[tuple[int, ...]] = set()
        self.failing = False
        self.requests = 0

    def serve(self, prompt: list[int]) -> int:
        """The number of the prompt's full blocks found cached."""
        full = len(prompt) // BLOCK
        hit = 0
        while hit < full and tuple(prompt[:(hit + 1) * BLOCK]) in self.cached:
            hit += 1
        self.cached.update(tuple(prompt[:(j + 1) * BLOCK]) for j in range(full))
        return hit


def fake_cluster(policy, n: int = 4) -> tuple[Router, dict[str, FakeEngine]]:
    engines = {f"engine-{i}": FakeEngine(f"engine-{i}") for i in range(n)}

    def handle(request: httpx.Request) -> httpx.Response:
        engine = engines[request.url.host]
        if request.url.path == "/stats":  # what the router's poller reads
            if engine.failing:
                return httpx.Response(500, json={"error": {"message": "engine dead"}})
            return httpx.Response(200, json={"waiting": 0, "running": 0,
                                             "kv_cache_usage_perc": 0.0, "engine_alive": True})
        engine.requests += 1
        assert engine.requests < 1000, "the router keeps asking the same replica"
        if engine.failing:  # what a replica whose engine died answers, before it exits
            return httpx.Response(503, json={"error": {"message": "engine dead",
                                                       "code": "engine_dead"}})
        prompt = json.loads(request.content)["prompt"]
        return httpx.Response(200, json={"served_by": engine.name,
                                         "cached_blocks": engine.serve(prompt)})

    router = Router(replicas(n), Checked(policy), lambda path, body: list(body["prompt"]),
                    replica_timeout_s=60.0)
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    return router, engines


class Checked:
    """The policy under test, as the router calls it, with its answer checked."""

    def __init__(self, policy):
        self.policy = policy

    def choose(self, prompt_token_ids, replicas):
        chosen = self.policy.choose(prompt_token_ids, replicas)
        assert is_one_of(chosen, list(replicas)), \
            f"chose {getattr(chosen, 'name', chosen)!r}, not one of the replicas the router " \
            f"listed ({[r.name for r in replicas]}: it leaves out those it already tried)"
        assert chosen.healthy, f"chose {chosen.name}, which the router has marked down"
        return chosen


async def send(router: Router, prompt: list[int]) -> dict:
    answer = await router.route("/v1/completions", {"prompt": prompt, "max_tokens": 1},
                                client_request())
    assert answer.status_code == 200, answer.body
    return json.loads(answer.body)


def client_request() -> Request:
    """A client's request as the router's routes hand it on: no headers,
    and a client that never hangs up."""
    async def receive() -> dict:
        await asyncio.Event().wait()  # no disconnect, ever
        return {}
    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "headers": [], "query_string": b""}, receive)


def chat_workload(num_conversations: int, turns: int) -> list[list[list[int]]]:
    """Each conversation's prompts, turn by turn: a shared system prompt of
    2 blocks, a first message, then each turn adds an answer and a new
    message to the history (the whole history is the next prompt)."""
    rng = random.Random(9)
    system = tokens(10, 2 * BLOCK)
    conversations = []
    for c in range(num_conversations):
        prompt = system + tokens(100 + c, rng.randrange(40, 80))
        prompts = [prompt]
        for t in range(turns - 1):
            prompt = prompt + tokens(1000 * c + t, rng.randrange(50, 110))
            prompts.append(prompt)
        conversations.append(prompts)
    return conversations


def run_workload(policy, conversations) -> tuple[list[tuple[int, int]], dict[str, FakeEngine]]:
    """Every conversation's turns through the router, interleaved; for each
    later turn, (full blocks of the previous turn's prompt, blocks found cached)."""
    router, engines = fake_cluster(policy)
    later_turns = []

    async def run():
        for turn in range(len(conversations[0])):
            for prompts in conversations:
                answer = await send(router, prompts[turn])
                if turn:
                    later_turns.append((len(prompts[turn - 1]) // BLOCK,
                                        answer["cached_blocks"]))
        await router.client.aclose()

    asyncio.run(run())
    return later_turns, engines


def test_the_router_with_your_policy_finds_every_earlier_turn_cached(impl):
    """17 conversations of 5 turns through the course's router in front of 4
    fake engines: at every turn after the first, the engine that serves it
    already holds every full block of the conversation's previous turn.
    (Round robin, on the same workload, finds a fraction of them.)"""
    conversations = chat_workload(17, 5)
    policy = impl.PrefixAwarePolicy(block_size=BLOCK, prefix_blocks=PREFIX_BLOCKS)
    later_turns, engines = run_workload(policy, conversations)
    missed = [(full, hit) for full, hit in later_turns if hit < full]
    assert not missed, (
        f"{len(missed)} of {len(later_turns)} later turns were served where their history "
        f"is not cached (full blocks of the previous turn, found cached): {missed[:5]}")
    busy = [e.name for e in engines.values() if e.requests]
    assert len(busy) >= 3, f"17 conversations all went to {busy}"
    round_robin, _ = run_workload(RoundRobinPolicy(), conversations)
    assert sum(hit for _, hit in round_robin) < 0.5 * sum(full for full, _ in round_robin), \
        "the workload should tell a prefix-aware policy from round robin"


def test_the_router_retries_elsewhere_and_comes_back(impl):
    """The replica of a conversation fails (a 503 `engine_dead`: its engine
    died): the router marks it down and tries again, and your policy must send the
    request, and the conversation's next turns, to one other replica, not
    back to the one that is down. Once it is up again (the router's poller
    reads its /stats), the conversation returns to it."""
    policy = impl.PrefixAwarePolicy(block_size=BLOCK, prefix_blocks=PREFIX_BLOCKS)
    router, engines = fake_cluster(policy)
    history = tokens(11, 6 * BLOCK)

    async def run():
        nonlocal history
        home = (await send(router, history))["served_by"]
        engines[home].failing = True
        history = history + tokens(12, 40)
        elsewhere = (await send(router, history))["served_by"]
        assert elsewhere != home and router.stats.retries == 1
        for turn in range(3):
            history = history + tokens(13 + turn, 40)
            answer = await send(router, history)
            assert answer["served_by"] == elsewhere, \
                "while its replica is down, a conversation stays on the one it moved to"
            assert answer["cached_blocks"] > 0
        assert router.stats.retries == 1, "the router had to retry again: a replica " \
            "marked down was chosen"
        engines[home].failing = False
        await router.poll(next(r for r in router.replicas if r.name == home))
        history = history + tokens(20, 40)
        assert (await send(router, history))["served_by"] == home, \
            "its replica is up again: the conversation goes back to it"
        await router.client.aclose()

    asyncio.run(run())
