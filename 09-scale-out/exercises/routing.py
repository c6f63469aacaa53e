"""Exercise 09: the prefix-aware router's policy, by consistent hashing.

A router in front of N replicas of the engine (chapter 09's
common/entrypoints/router.py) asks a policy, for every request, which
replica serves it. You write the policy that keeps a conversation on the
replica that already holds its first KV blocks in its prefix cache
(chapter 04), so that its earlier turns and its system prompt are not
prefilled again elsewhere:

    prompt token ids -> the names of its first full blocks (chained)
                     -> the last of those names, a key on a ring
                     -> the first replica's point clockwise from the key

Three pieces, in that order:

1. `prefix_block_hashes`: the names of a prompt's first full blocks,
   chained like the engine's (block j's name covers every token before
   it), and the same in every process;
2. `HashRing`: consistent hashing. Each replica owns points on a ring of
   2**64; a key belongs to the first point at or after its own, going
   round. A replica that joins takes keys only from the arcs it lands on;
   one that leaves (or is down) gives only its own keys to its
   neighbours: every other replica's cache stays warm;
3. `PrefixAwarePolicy.choose`: the two together, skipping replicas that
   are down, with a fallback for prompts too short to have a full block.

Graded by `make exercise CH=09` (the tests marked `ex09` in
tests/test_ch09_routing_exercise.py): fake replicas only, no model, no
server; the last two put your policy in the course's real `Router` in
front of fake engines that keep a prefix cache. exercises/README.md has
the tasks and the hints; a failing test names the hint to read first.
Once every test passes, compare with common/entrypoints/routing.py.

Given (imported below): `Replica` (a name, a URL, `healthy`, its `load`),
`NoReplicaError`, `healthy()` (the healthy replicas of a list, or
NoReplicaError), `LeastLoadedPolicy` and `ring_point` (a string's place
on the ring, the same in every process). Left out, as in the course's
policy: routing by what each replica really holds (vLLM's KV events),
a load threshold above which a prefix gives way to the least loaded
replica, weights per replica, a session id in a header.
"""
from __future__ import annotations

from typing import Sequence

from common.entrypoints.routing import (  # noqa: F401 - given: use them
    LeastLoadedPolicy,
    NoReplicaError,
    Replica,
    healthy,
    ring_point,
)


def prefix_block_hashes(token_ids: Sequence[int], block_size: int,
                        max_blocks: int) -> list[int]:
    """The names of the prompt's first full blocks, at most `max_blocks` of them.

    token_ids:  the prompt, e.g. 70 ids with block_size 16: 4 full blocks
                (tokens 0-15, 16-31, 32-47, 48-63) and 6 left over, which
                are not a block yet and get no name
    returns:    one int per full block, in order, at most max_blocks:
                names[j] depends on the tokens of blocks 0..j, all of
                them, and on nothing after block j

    The router computes these in its own process, and a second router
    (or this one, restarted) must compute the same: the names must not
    change from one Python process to the next.
    """
    # Stuck? exercises/README.md, hints 1 and 2.
    raise NotImplementedError("prefix_block_hashes: the chained names of the first "
                              "min(len // block_size, max_blocks) full blocks")


class HashRing:
    """Consistent hashing over replica names.

    Replica `name` owns `points_per_replica` points on a ring of 2**64:
    `ring_point(f"{name}#{i}")` for i in 0 .. points_per_replica - 1.
    A key (an int: a block's name) sits at `ring_point(str(key))` and
    belongs to the first point at or after it, going clockwise and
    wrapping from the largest point to the smallest. Two routers that
    follow this rule agree on every key.
    """

    def __init__(self, names: Sequence[str] = (), points_per_replica: int = 100):
        self.points_per_replica = points_per_replica
        self._points: list[int] = []  # every replica's points, kept sorted
        self._owner: dict[int, str] = {}  # point -> the replica that owns it
        for name in names:
            self.add(name)

    def add(self, name: str) -> None:
        """Put the replica's points on the ring (keeping `_points` sorted)."""
        # Stuck? exercises/README.md, hints 3 and 6.
        raise NotImplementedError("HashRing.add: the replica's points, in order")

    def remove(self, name: str) -> None:
        """Take every one of the replica's points off the ring."""
        # Stuck? exercises/README.md, hint 6.
        raise NotImplementedError("HashRing.remove: drop all of the replica's points")

    def names(self) -> set[str]:
        """The replicas on the ring."""
        return set(self._owner.values())

    def owner(self, key: int, usable: set[str] | None = None) -> str:
        """The replica that owns `key`: the owner of the first point at or
        after `ring_point(str(key))`, clockwise. With `usable`, points of
        replicas not in it are passed over: the next point clockwise of
        a usable replica. NoReplicaError if the ring is empty or no
        point belongs to a usable replica.
        """
        # Stuck? exercises/README.md, hints 3 and 4.
        raise NotImplementedError("HashRing.owner: the first (usable) point clockwise "
                                  "from the key's")


class PrefixAwarePolicy:
    """The same first blocks, the same replica.

    `choose` is called by the router for every request, with the replicas
    it may use (those it has already tried for this request are left out
    of the list) and the prompt's token ids. Replicas that are listed but
    down (`healthy` False) stay on the ring, passed over: when they come
    back, so do their prefixes. A replica that is no longer listed leaves
    the ring; a new one joins it.
    """

    def __init__(self, block_size: int = 16, prefix_blocks: int = 4,
                 points_per_replica: int = 100):
        self.block_size = block_size  # the engines' (16, vLLM's default)
        self.prefix_blocks = prefix_blocks  # how many first blocks name a prefix
        self.ring = HashRing(points_per_replica=points_per_replica)
        self.fallback = LeastLoadedPolicy()  # for prompts without a full block

    def choose(self, prompt_token_ids: Sequence[int], replicas: Sequence[Replica]) -> Replica:
        """The replica for this prompt, one of `replicas` and healthy.

        The name of the last of the prompt's first `prefix_blocks` full
        blocks is the key (it names the ones before it too); a prompt
        shorter than one block has none and goes to the least loaded
        healthy replica. NoReplicaError when no listed replica is healthy.
        """
        # Stuck? exercises/README.md, hints 4, 5 and 7.
        raise NotImplementedError("PrefixAwarePolicy.choose: the ring's owner of the "
                                  "prefix's key, among the healthy replicas")

    def _follow(self, replicas: Sequence[Replica]) -> None:
        """Make the ring's members the replicas listed, up or down."""
        # Stuck? exercises/README.md, hint 6.
        raise NotImplementedError("PrefixAwarePolicy._follow: add the new, remove the gone")
