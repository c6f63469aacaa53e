"""ch09 (in progress): the router's policies (common/entrypoints/routing.py),
on fake replicas: no engine, no HTTP."""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from common.entrypoints.routing import (
    HashRing,
    LeastLoadedPolicy,
    NoReplicaError,
    PrefixAwarePolicy,
    Replica,
    ReplicaLoad,
    RoundRobinPolicy,
    prefix_block_hashes,
)

BLOCK = 16
ROOT = Path(__file__).resolve().parents[1]


def replicas(n: int) -> list[Replica]:
    return [Replica(f"engine-{i}", f"http://127.0.0.1:{8100 + i}") for i in range(n)]


def conversation(seed: int, length: int = 5 * BLOCK) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 49152) for _ in range(length)]


def test_round_robin_takes_each_healthy_replica_in_turn():
    pool = replicas(3)
    policy = RoundRobinPolicy()
    assert [policy.choose([1], pool).name for _ in range(6)] == \
        ["engine-0", "engine-1", "engine-2"] * 2
    pool[1].healthy = False
    assert {policy.choose([1], pool).name for _ in range(4)} == {"engine-0", "engine-2"}


def test_least_loaded_reads_waiting_then_running_then_kv_usage():
    pool = replicas(3)
    pool[0].load = ReplicaLoad(num_waiting=2, num_running=1, kv_usage_perc=10.0)
    pool[1].load = ReplicaLoad(num_waiting=0, num_running=8, kv_usage_perc=90.0)
    pool[2].load = ReplicaLoad(num_waiting=0, num_running=8, kv_usage_perc=40.0)
    assert LeastLoadedPolicy().choose([1], pool).name == "engine-2"
    pool[2].healthy = False
    assert LeastLoadedPolicy().choose([1], pool).name == "engine-1"


def test_no_healthy_replica_is_an_error_not_a_guess():
    pool = replicas(2)
    for r in pool:
        r.healthy = False
    for policy in (RoundRobinPolicy(), LeastLoadedPolicy(), PrefixAwarePolicy()):
        with pytest.raises(NoReplicaError):
            policy.choose(conversation(0), pool)


def test_block_names_are_chained_full_blocks_the_same_in_every_process():
    ids = conversation(1, 3 * BLOCK + 5)
    first, second = prefix_block_hashes(ids, BLOCK, 2)
    assert prefix_block_hashes(ids[:BLOCK], BLOCK, 4) == [first]
    other = ids[:BLOCK - 1] + [ids[BLOCK - 1] + 1] + ids[BLOCK:]
    assert prefix_block_hashes(other, BLOCK, 2)[1] != second  # block 1 names block 0 too
    assert len(prefix_block_hashes(ids, BLOCK, 10)) == 3  # full blocks only
    assert prefix_block_hashes(ids[:BLOCK - 1], BLOCK, 4) == []
    code = ("from common.entrypoints.routing import prefix_block_hashes;"
            f"print(prefix_block_hashes({ids!r}, {BLOCK}, 2))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, cwd=ROOT).stdout for _ in range(2)}
    assert runs == {f"{[first, second]}\n"}


def test_prefix_aware_keeps_a_conversation_on_one_replica_whatever_follows():
    """Turn after turn the prompt grows; its first blocks stay the same, so
    its replica does, where those blocks are cached."""
    pool = replicas(4)
    policy = PrefixAwarePolicy(block_size=BLOCK, prefix_blocks=4)
    history = conversation(7)
    first = policy.choose(history, pool).name
    for turn in range(5):
        history = history + conversation(100 + turn, 2 * BLOCK)
        assert policy.choose(history, pool).name == first


def test_prefix_aware_spreads_different_prefixes_over_every_replica():
    pool = replicas(4)
    policy = PrefixAwarePolicy(block_size=BLOCK)
    counts = {r.name: 0 for r in pool}
    for seed in range(2000):
        counts[policy.choose(conversation(seed), pool).name] += 1
    assert min(counts.values()) > 2000 / 4 * 0.6, counts  # no replica starves


def test_a_prompt_shorter_than_a_block_goes_to_the_least_loaded():
    pool = replicas(3)
    pool[0].load.num_waiting = 5
    pool[1].load.num_waiting = 1
    pool[2].load.num_waiting = 3
    assert PrefixAwarePolicy(block_size=BLOCK).choose([1, 2, 3], pool).name == "engine-1"


def owners(policy: PrefixAwarePolicy, pool: list[Replica], n: int = 1500) -> dict[int, str]:
    return {seed: policy.choose(conversation(seed), pool).name for seed in range(n)}


def test_a_joining_replica_takes_only_its_share_from_the_others():
    pool = replicas(4)
    policy = PrefixAwarePolicy(block_size=BLOCK)
    before = owners(policy, pool)
    after = owners(policy, pool + [Replica("engine-4")])
    moved = [seed for seed in before if before[seed] != after[seed]]
    assert all(after[seed] == "engine-4" for seed in moved)  # only to the newcomer
    assert 0.1 < len(moved) / len(before) < 0.3  # about 1/5


def test_a_leaving_or_down_replica_moves_only_its_own_prefixes_and_gets_them_back():
    pool = replicas(4)
    policy = PrefixAwarePolicy(block_size=BLOCK)
    before = owners(policy, pool)
    pool[2].healthy = False
    down = owners(policy, pool)
    for seed, name in before.items():
        if name == "engine-2":
            assert down[seed] != "engine-2"
        else:
            assert down[seed] == name  # the others stay warm
    pool[2].healthy = True
    assert owners(policy, pool) == before  # back up: its prefixes come back
    gone = owners(policy, [r for r in pool if r.name != "engine-2"])
    assert gone == down  # removed for good: the same as down


def test_the_ring_is_the_same_in_every_process():
    """Points come from blake2b, not Python's hash() of a str (salted per
    process): two routers, or a restarted one, agree."""
    ring = HashRing(["a", "b", "c"], points_per_replica=50)
    again = HashRing(["c", "a", "b"], points_per_replica=50)
    keys = [prefix_block_hashes(conversation(i, BLOCK), BLOCK, 1)[0] for i in range(300)]
    assert [ring.owner(k) for k in keys] == [again.owner(k) for k in keys]
