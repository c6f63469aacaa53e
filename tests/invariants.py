"""What must hold after every operation of the block manager and every
step of the scheduler, whoever wrote them (the reference or a learner).

The checks read only the state the exercise stubs keep too (`blocks` with
their `ref_count`, `hash` and `token_ids`, `free_blocks`,
`hash_to_block`, the sequences' block tables), so they grade exercise 04
and 05 as well as `common/`.

`KVShadow` stands in for the KV cache tensor: the tests write into it what
a forward pass would write (for token i of a sequence: that token and the
exact prefix it attends to), through the block tables. A sequence that
claims `num_computed_tokens` computed tokens must then find its own K/V in
every one of those slots. That is the property users feel: a block handed
to two sequences at once, or a prefix-cache hit on a block that someone
overwrote, gives a sequence another request's K/V, and wrong tokens.

Left out: timing, and the policy's choices (which free block is taken,
which sequence is preempted) beyond what the chapters specify.
"""
from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass


class InvariantError(AssertionError):
    """An invariant broke; the message says which and where."""


def fail(what: str) -> None:
    raise InvariantError(what)


def prefix_id(seq, i: int) -> tuple[int, int]:
    """What slot i of `seq` must hold: its token and the exact prefix it
    attends to (the K/V of token i depend on every token before it)."""
    return hash(tuple(seq.token_ids[:i + 1])), seq.token_ids[i]


def slot(bm, seq, i: int) -> int:
    """The cache slot of token i of `seq`, through its block table."""
    return seq.block_table[i // bm.block_size] * bm.block_size + i % bm.block_size


class KVShadow:
    """The KV cache as the tests see it: slot -> (prefix id, token id)."""

    def __init__(self):
        self.slots: dict[int, tuple[int, int]] = {}

    def write(self, bm, seq, start: int, end: int) -> None:
        """A forward pass fed seq's tokens [start, end): their K/V land in
        their slots."""
        for i in range(start, end):
            if i // bm.block_size >= len(seq.block_table):
                fail(f"request {seq.request_id}: token {i} is fed but its block table has only "
                     f"{len(seq.block_table)} blocks of {bm.block_size}: no slot for its K/V")
            self.slots[slot(bm, seq, i)] = prefix_id(seq, i)

    def check(self, bm, seq) -> None:
        """seq's computed tokens read their own K/V, not another request's."""
        for i in range(seq.num_computed_tokens):
            if self.slots.get(slot(bm, seq, i)) != prefix_id(seq, i):
                block_id = seq.block_table[i // bm.block_size]
                fail(f"request {seq.request_id}: token {i} is counted as computed, but block "
                     f"{block_id} (its block {i // bm.block_size}) holds other K/V: the block "
                     "was handed to another sequence, or a prefix-cache hit found a block "
                     "that had been overwritten")

    def block_tokens(self, bm, block_id: int) -> tuple[int | None, ...]:
        start = block_id * bm.block_size
        return tuple(self.slots.get(s, (None, None))[1] for s in range(start, start + bm.block_size))


def check_block_manager(bm, holders, shadow: KVShadow | None = None) -> None:
    """The block manager's invariants. `holders`: every sequence that has
    been allocated blocks and not deallocated since."""
    tables = [seq.block_table for seq in holders]
    in_tables = Counter(b for table in tables for b in table)
    free = list(bm.free_blocks)
    for seq in holders:
        if len(set(seq.block_table)) != len(seq.block_table):
            fail(f"request {seq.request_id}: a block appears twice in its table "
                 f"{seq.block_table}")
    if len(set(free)) != len(free):
        fail("a block is twice in the free list")
    both = sorted(set(free) & set(in_tables))
    if both:
        fail(f"blocks {both} are in the free list AND in a block table: the next allocation "
             "hands them to a second sequence (a reused cached block must leave the free list)")
    for block in bm.blocks:
        if block.ref_count != in_tables[block.block_id]:
            fail(f"block {block.block_id}: ref_count {block.ref_count}, but "
                 f"{in_tables[block.block_id]} block tables hold it")
        if block.ref_count == 0 and block.block_id not in bm.free_blocks:
            fail(f"block {block.block_id} is in no block table and not in the free list: lost")
    if len(free) + len(in_tables) != bm.num_blocks:
        fail(f"{len(free)} free + {len(in_tables)} in tables != {bm.num_blocks} blocks")
    if bm.num_free_blocks != len(free) or bm.num_used_blocks != bm.num_blocks - len(free):
        fail(f"num_free_blocks {bm.num_free_blocks} / num_used_blocks {bm.num_used_blocks}, "
             f"but {len(free)} blocks are free out of {bm.num_blocks}")
    for block_hash, block_id in bm.hash_to_block.items():
        block = bm.blocks[block_id]
        if block.hash != block_hash:
            fail(f"hash_to_block sends a hash to block {block_id}, which no longer holds it "
                 f"(its hash is {block.hash}): the block was taken from the free list for new "
                 "tokens without leaving the prefix cache, so a later prompt would 'hit' K/V "
                 "that are being overwritten")
        if len(block.token_ids) != bm.block_size:
            fail(f"block {block_id} is in the prefix cache but holds {len(block.token_ids)} "
                 f"token ids, not a full block of {bm.block_size}")
        if shadow is not None and shadow.block_tokens(bm, block_id) != tuple(block.token_ids):
            fail(f"block {block_id} is in the prefix cache for tokens {block.token_ids}, but "
                 "its slots hold other K/V")
    for seq in holders:
        if shadow is not None:
            shadow.check(bm, seq)
        computed_blocks = seq.num_computed_tokens // bm.block_size
        for j, block_id in enumerate(seq.block_table[computed_blocks:], start=computed_blocks):
            if bm.hash_to_block.get(bm.blocks[block_id].hash) == block_id:
                fail(f"request {seq.request_id}: its block {j} (block {block_id}) is in the "
                     "prefix cache before it is full and computed: another prompt could reuse "
                     "K/V that are not written yet")
    check_usage(bm, holders)


def check_usage(bm, holders) -> None:
    """`usage` against a count of distinct slots holding a computed token
    (a block shared by several sequences counted once)."""
    computed_slots = {slot(bm, seq, i) for seq in holders for i in range(seq.num_computed_tokens)}
    used_blocks = bm.num_blocks - len(bm.free_blocks)
    usage = bm.usage(list(holders))
    expected = (bm.num_blocks, used_blocks, used_blocks * bm.block_size, len(computed_slots))
    got = (usage.num_blocks, usage.used_blocks, usage.reserved_slots, usage.used_slots)
    if got != expected:
        fail(f"usage(): (num_blocks, used_blocks, reserved_slots, used_slots) = {got}, but "
             f"the tables give {expected} (a shared block's slots count once)")
    reserved, used = expected[2], expected[3]
    waste = 100.0 * (reserved - used) / reserved if reserved else 0.0
    if abs(usage.waste_perc - waste) > 1e-6 or abs(
            usage.usage_perc - 100.0 * used_blocks / bm.num_blocks) > 1e-6:
        fail(f"usage(): waste_perc {usage.waste_perc} / usage_perc {usage.usage_perc}, "
             f"expected {waste} / {100.0 * used_blocks / bm.num_blocks}")


def would_succeed(bm, holders, seq, operation: str) -> bool:
    """Does `operation` ('allocate' or 'may_append') on `seq` work, on a
    copy of the block manager? What `can_allocate` / `can_append` must
    predict: yes exactly when the blocks are there."""
    bm_copy, seq_copy = copy.deepcopy((bm, seq))
    try:
        getattr(bm_copy, operation)(seq_copy)
        needed = -(-seq_copy.num_tokens // bm.block_size)
        ok = len(seq_copy.block_table) >= needed
        others = [s for s in holders if s is not seq]
        copies = [copy.copy(s) for s in others]  # same tables: the copy's blocks are by id
        check_block_manager(bm_copy, copies + [seq_copy])
        return ok
    except Exception:  # out of free blocks, or the copy broke an invariant
        return False


@dataclass
class Before:
    """The scheduler's queues before a `schedule()`."""
    running: list
    waiting: list
    num_preemptions: dict  # id(seq) -> seq.num_preemptions

    @classmethod
    def of(cls, sched) -> "Before":
        return cls(list(sched.running), list(sched.waiting),
                   {id(s): s.num_preemptions for s in sched.running})


def check_scheduler_step(sched, batch, before: Before) -> None:
    """What one `schedule()` must respect, whatever the policy (chapter
    05's preemption rules apply only when something was preempted)."""
    total = sum(item.num_new_tokens for item in batch)
    if total > sched.max_num_batched_tokens:
        fail(f"the batch feeds {total} tokens, more than max_num_batched_tokens "
             f"= {sched.max_num_batched_tokens}")
    if len(sched.running) > sched.max_num_seqs:
        fail(f"{len(sched.running)} sequences running, more than max_num_seqs "
             f"= {sched.max_num_seqs}")
    seqs = [item.seq for item in batch]
    if len(set(map(id, seqs))) != len(seqs):
        fail("a sequence is twice in one batch")
    for item in batch:
        seq = item.seq
        if item.num_new_tokens <= 0:
            fail(f"request {seq.request_id} is scheduled with {item.num_new_tokens} tokens")
        if seq not in sched.running:
            fail(f"request {seq.request_id} is in the batch but not running (preempted?)")
        end = seq.num_computed_tokens + item.num_new_tokens
        if end > seq.num_tokens:
            fail(f"request {seq.request_id}: feeds up to token {end}, it has {seq.num_tokens}")
        if len(seq.block_table) * sched.bm.block_size < end:
            fail(f"request {seq.request_id} feeds tokens up to {end} but holds only "
                 f"{len(seq.block_table)} blocks of {sched.bm.block_size}")
    for seq in sched.waiting:
        if seq.block_table != [] or seq.num_computed_tokens != 0:
            fail(f"request {seq.request_id} waits but still holds blocks {seq.block_table} "
                 f"(num_computed_tokens {seq.num_computed_tokens}): a preempted sequence "
                 "gives all its blocks back and recomputes from its cached prefix")
    preempted = [s for s in before.running if s.num_preemptions > before.num_preemptions[id(s)]]
    if not preempted:
        return
    names = [s.request_id for s in preempted]
    if before.running[-len(preempted):] != preempted:
        fail(f"preempted {names}, but the newest running were "
             f"{[s.request_id for s in before.running[-len(preempted):]]}: chapter 05 "
             "preempts the newest first")
    if list(sched.waiting)[:len(preempted)] != preempted:
        fail(f"preempted {names}, but the queue now starts with "
             f"{[s.request_id for s in list(sched.waiting)[:len(preempted)]]}: a preempted "
             "sequence goes back to the FRONT of the queue (it arrived before the others)")
    joined = [s.request_id for s in seqs if s in before.waiting or s in preempted]
    if joined:
        fail(f"the step preempted {names} and still admitted {joined}: under pressure "
             "(something was just preempted) nobody joins in the same step")


def checked(block_manager_cls: type) -> type:
    """`block_manager_cls` with `check_block_manager` run after every call
    that changes it: the engine tests build their engines with it
    (tests/engine_helpers.py), so every step of every engine test checks
    the invariants, whoever wrote the block manager."""

    class Checked(block_manager_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.holders: dict[int, object] = {}  # id(seq) -> seq, those holding blocks

        def check(self) -> None:
            check_block_manager(self, list(self.holders.values()))

        def allocate(self, seq) -> None:
            super().allocate(seq)
            self.holders[id(seq)] = seq
            self.check()

        def deallocate(self, seq) -> None:
            super().deallocate(seq)
            self.holders.pop(id(seq), None)
            self.check()

        def may_append(self, seq, *args) -> None:
            super().may_append(seq, *args)
            self.check()

        def cache_full_blocks(self, seq) -> None:
            super().cache_full_blocks(seq)
            self.check()

    Checked.__name__ = Checked.__qualname__ = f"Checked{block_manager_cls.__name__}"
    return Checked
