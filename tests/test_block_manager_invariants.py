"""The block manager's invariants, under random interleavings of admit,
compute, append, finish, preempt and recompute (hypothesis), with prefix
caching on and off, small pools and prompts that share prefixes; and the
bugs they exist for, each pinned by a small test.

Graded (ex04): they run on the learner's `BlockManager` too.
tests/invariants.py says what is checked and why.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.core.sequence import Sequence
from common.sampling_params import SamplingParams
from tests.invariants import InvariantError, KVShadow, check_block_manager, would_succeed

pytestmark = [pytest.mark.ch04, pytest.mark.ex04]

# Derandomized: the same examples on every machine and every run (CI must
# not flake); enough of them to reach the interleavings that matter.
PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=150,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Prompts built from a few shared openings (a system prompt, a chat turn)
# and a random tail over a tiny vocabulary, so that equal blocks behind
# different prefixes (hash chains) and whole-prompt hits both happen.
OPENINGS = [(), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9), (5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5)]


def new_seq(request_id: str, tokens, max_tokens: int = 64) -> Sequence:
    return Sequence(request_id, list(tokens), SamplingParams(max_tokens=max_tokens))


class Pool:
    """A block manager driven the way the scheduler drives it, with the
    invariants checked after every operation."""

    def __init__(self, bm):
        self.bm = bm
        self.shadow = KVShadow()
        self.running: list[Sequence] = []  # hold blocks
        self.preempted: list[Sequence] = []  # hold none, keep their tokens
        self.count = 0

    def check(self) -> None:
        check_block_manager(self.bm, self.running, self.shadow)

    def admit(self, seq: Sequence) -> bool:
        """can_allocate, then allocate; the prefix-cache counters move by
        the full prompt blocks looked up and the blocks found."""
        predicted = self.bm.can_allocate(seq)
        possible = would_succeed(self.bm, self.running, seq, "allocate")
        if predicted != possible:
            raise InvariantError(
                f"can_allocate says {predicted} for a request of {seq.num_tokens} tokens with "
                f"{self.bm.num_free_blocks} free blocks, but allocating "
                f"{'works' if possible else 'fails'} (a cached block another sequence uses "
                "costs no free block; a cached free block costs one)")
        if not predicted:
            return False
        queries, hits = self.bm.prefix_queries, self.bm.prefix_hits
        self.bm.allocate(seq)
        self.running.append(seq)
        num_hit = seq.num_computed_tokens // self.bm.block_size
        if seq.num_computed_tokens != seq.num_cached_tokens or seq.num_computed_tokens % self.bm.block_size:
            raise InvariantError(
                f"after allocate: num_computed_tokens {seq.num_computed_tokens}, "
                f"num_cached_tokens {seq.num_cached_tokens} (both: whole cached blocks)")
        expected = ((seq.num_prompt_tokens // self.bm.block_size, num_hit)
                    if self.bm.enable_prefix_caching else (0, 0))
        counted = (self.bm.prefix_queries - queries, self.bm.prefix_hits - hits)
        if counted != expected:
            raise InvariantError(
                f"allocate counted (prefix_queries, prefix_hits) += {counted}, expected "
                f"{expected}: the full prompt blocks looked up, the blocks reused")
        if seq.num_computed_tokens >= seq.num_tokens:
            raise InvariantError("a prefix-cache hit covered the whole sequence: the last "
                                 "token must be computed again to get its logits")
        self.check()
        return True

    def compute(self, seq: Sequence, num_tokens: int, new_token: int) -> None:
        """One forward pass feeds `num_tokens` of seq; if that reaches its
        end, a token is sampled and appended, and room made for it."""
        start = seq.num_computed_tokens
        end = min(seq.num_tokens, start + num_tokens)
        self.shadow.write(self.bm, seq, start, end)
        seq.num_computed_tokens = end
        self.bm.cache_full_blocks(seq)
        self.check()
        if end == seq.num_tokens:
            seq.token_ids.append(new_token)
            seq.output_token_ids.append(new_token)
            self.make_room(seq)

    def make_room(self, seq: Sequence) -> None:
        predicted = self.bm.can_append(seq)
        possible = would_succeed(self.bm, self.running, seq, "may_append")
        if predicted != possible:
            raise InvariantError(
                f"can_append says {predicted} for a sequence of {seq.num_tokens} tokens in "
                f"{len(seq.block_table)} blocks of {self.bm.block_size} with "
                f"{self.bm.num_free_blocks} free, but appending {'works' if possible else 'fails'}")
        if predicted:
            self.bm.may_append(seq)
            self.check()
        else:
            self.release(seq, preempt=True)

    def release(self, seq: Sequence, preempt: bool) -> None:
        self.running.remove(seq)
        self.bm.deallocate(seq)
        if seq.block_table != [] or seq.num_computed_tokens != 0:
            raise InvariantError("after deallocate the sequence still has a block table or "
                                 "computed tokens (both must be back to [] and 0)")
        if preempt:
            self.preempted.append(seq)
        self.check()


def room_for_last_token(bm, seq) -> bool:
    return len(seq.block_table) * bm.block_size >= seq.num_tokens



def computed_prompt(pool, request_id, prompt):
    """Admit a prompt and compute it whole (its full blocks enter the cache)."""
    seq = new_seq(request_id, prompt)
    assert pool.admit(seq)
    pool.compute(seq, len(prompt), new_token=3)
    return seq


def test_a_pool_of_one_block_works_and_of_none_is_refused(impl):
    """Chapter 03's contiguous cache can be a single region: one block is a
    pool. None is not, and says so."""
    pool = Pool(impl.BlockManager(1, 4))
    seq = new_seq("only", [1, 2, 3])
    assert pool.admit(seq)
    pool.compute(seq, 3, new_token=1)  # 4 tokens: still the one block
    with pytest.raises(ValueError, match="^the KV cache needs at least one block$"):
        impl.BlockManager(0, 4)


def test_prefix_caching_is_off_unless_asked_for(impl):
    """`BlockManager(num_blocks, block_size)` caches no prefix (vLLM's
    `--enable-prefix-caching` is a choice): two equal prompts share nothing."""
    pool = Pool(impl.BlockManager(8, 4))
    first = computed_prompt(pool, "first", [1, 2, 3, 4, 5])
    second = computed_prompt(pool, "second", [1, 2, 3, 4, 5])
    assert second.num_cached_tokens == 0 and not set(first.block_table) & set(second.block_table)


def test_the_block_freed_first_is_handed_out_first(impl):
    """Lazy eviction, oldest first: freed blocks keep their K/V (and their
    place in the prefix cache) until the space is needed, and the one freed
    longest ago goes first, so the most recent prefixes stay cached."""
    pool = Pool(impl.BlockManager(3, 4, enable_prefix_caching=True))
    old = computed_prompt(pool, "old", [1, 1, 1, 1])  # 1 full block + 1 for its next token
    pool.release(old, preempt=False)
    recent = computed_prompt(pool, "recent", [2, 2, 2, 2])  # takes the third and old's second
    pool.release(recent, preempt=False)
    computed_prompt(pool, "filler", [3])  # one block: the oldest freed, old's
    assert bm_hits(pool, [2, 2, 2, 2, 5]) == 4, "the block freed last should still hit"
    assert bm_hits(pool, [1, 1, 1, 1, 5]) == 0, "the block freed first should have been reused"


def bm_hits(pool, prompt) -> int:
    """Cached tokens a new prompt would start with (admitted, then freed)."""
    seq = new_seq("probe", prompt)
    assert pool.admit(seq)
    pool.release(seq, preempt=False)
    return seq.num_cached_tokens


def test_a_reused_free_cached_block_leaves_the_free_list(impl):
    """A prefix hit on a block that is free but still cached takes it OFF
    the free list; else the next prompt is handed the same physical block
    and overwrites the K/V the first one reads."""
    pool = Pool(impl.BlockManager(5, 4, enable_prefix_caching=True))
    first = computed_prompt(pool, "first", [1, 2, 3, 4, 5])
    pool.release(first, preempt=False)  # its full block stays cached, on the free list
    again = computed_prompt(pool, "again", [1, 2, 3, 4, 6])  # hits it
    assert again.num_cached_tokens == 4
    other = computed_prompt(pool, "other", [7, 7, 7, 7, 7, 7, 7, 7, 7])  # takes 3 free blocks
    assert not set(other.block_table) & set(again.block_table)


def test_a_block_taken_from_the_free_list_no_longer_hits(impl):
    """A free block handed out for new tokens leaves the prefix cache: a
    later prompt with the old tokens must not 'hit' what is now someone
    else's K/V."""
    pool = Pool(impl.BlockManager(2, 4, enable_prefix_caching=True))
    first = computed_prompt(pool, "first", [1, 2, 3, 4, 5])
    pool.release(first, preempt=False)  # block [1 2 3 4] cached, free
    filler = computed_prompt(pool, "filler", [8, 8, 8, 8, 8, 8])  # overwrites both blocks
    pool.release(filler, preempt=False)
    late = new_seq("late", [1, 2, 3, 4, 5])
    assert pool.admit(late)
    assert late.num_cached_tokens == 0, "a prompt hit a block whose K/V were overwritten"


def test_usage_counts_a_shared_block_once(impl):
    """Two prompts sharing a full block: it is reserved once and its slots
    hold computed tokens once (the waste figure of /stats)."""
    pool = Pool(impl.BlockManager(8, 4, enable_prefix_caching=True))
    a = computed_prompt(pool, "a", [1, 2, 3, 4, 5, 6])
    b = computed_prompt(pool, "b", [1, 2, 3, 4, 7])
    assert a.block_table[0] == b.block_table[0]
    usage = pool.bm.usage([a, b])
    # blocks: the shared one, a's second (tokens 5-7), b's second (tokens 5-6)
    assert (usage.used_blocks, usage.reserved_slots) == (3, 12)
    assert usage.used_slots == 4 + 2 + 1  # computed: the shared 4 once, a's 2 more, b's 1 more
    assert usage.waste_perc == pytest.approx(100 * (12 - 7) / 12)


def test_can_allocate_counts_only_blocks_it_must_take(impl):
    """A hit on a block another sequence is using costs no free block; a
    hit on a free cached block costs one, like a fresh block."""
    bm = impl.BlockManager(4, 4, enable_prefix_caching=True)
    pool = Pool(bm)
    holder = computed_prompt(pool, "holder", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # 3 blocks, 1 free
    # 3 blocks needed, 2 of them are holder's cached blocks in use: 1 to take, 1 free
    assert bm.can_allocate(new_seq("x", [1, 2, 3, 4, 5, 6, 7, 8, 1]))
    assert not bm.can_allocate(new_seq("x2", [1, 2, 3, 4, 5, 6, 7, 8, 1, 1, 1, 1, 1]))
    pool.release(holder, preempt=False)  # 4 free, two of them still cached
    # 5 blocks needed, 2 cached but free: they leave the free list too, 5 > 4
    assert not bm.can_allocate(new_seq("z", [1, 2, 3, 4, 5, 6, 7, 8] + [1] * 9))
    assert bm.can_allocate(new_seq("y", [1, 2, 3, 4, 5, 6, 7, 8] + [1] * 8))


def test_prefix_cache_queries_and_hits_are_counted_per_full_prompt_block(impl):
    """`prefix_queries` counts the full prompt blocks looked up (the last
    token's block included), `prefix_hits` those reused."""
    bm = impl.BlockManager(16, 4, enable_prefix_caching=True)
    pool = Pool(bm)
    computed_prompt(pool, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # 2 full blocks, no hit
    assert (bm.prefix_queries, bm.prefix_hits) == (2, 0)
    computed_prompt(pool, "b", [1, 2, 3, 4, 5, 6, 7, 8, 11])  # 2 full, both hit
    assert (bm.prefix_queries, bm.prefix_hits) == (4, 2)
    computed_prompt(pool, "c", [1, 2, 3, 4, 5, 6, 7, 8])  # 2 full; the last is recomputed
    assert (bm.prefix_queries, bm.prefix_hits) == (6, 3)
    off = impl.BlockManager(16, 4, enable_prefix_caching=False)
    Pool(off).admit(new_seq("d", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert (off.prefix_queries, off.prefix_hits) == (0, 0)


def test_a_block_enters_the_prefix_cache_only_once_computed(impl):
    """A block full of prompt tokens whose K/V are not computed yet (the
    prompt is halfway through its chunked prefill) is not in the prefix
    cache: a prompt admitted now must not reuse K/V nobody has written."""
    pool = Pool(impl.BlockManager(8, 4, enable_prefix_caching=True))
    first = new_seq("first", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert pool.admit(first)
    pool.compute(first, 5, new_token=3)  # a chunk: block 0 computed, block 1 not yet
    second = new_seq("second", [1, 2, 3, 4, 5, 6, 7, 8, 1])
    assert pool.admit(second)
    assert second.num_cached_tokens == 4, "reused a block whose K/V are not computed"


def test_a_request_asking_for_prompt_logprobs_skips_the_prefix_cache(impl):
    """Chapter 06's prompt_logprobs need the logits of every prompt token,
    and a cached block has none: such a request computes its whole prompt
    (vLLM's rule), and still fills the cache for the others."""
    pool = Pool(impl.BlockManager(16, 4, enable_prefix_caching=True))
    computed_prompt(pool, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    asker = Sequence("b", [1, 2, 3, 4, 5, 6, 7, 8, 11],
                     SamplingParams(max_tokens=64, prompt_logprobs=0))
    assert pool.admit(asker)
    assert asker.num_cached_tokens == 0 and asker.num_computed_tokens == 0
    pool.compute(asker, asker.num_tokens, new_token=3)
    other = new_seq("c", [1, 2, 3, 4, 5, 6, 7, 8, 12])
    assert pool.admit(other)
    assert other.num_cached_tokens == 8


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-caching", "prefix-caching"])
@PROPERTY
@given(data=st.data())
def test_invariants_hold_under_random_operations(impl, prefix_caching, data):
    """Random admit / compute / finish / preempt / recompute on a small pool:
    after every operation, no block is both free and in a table, ref counts
    equal the tables holding each block, the prefix cache maps only to
    blocks holding that hash, free + used = total, `usage`, `can_allocate`
    and `can_append` agree with a count, and every computed token reads
    its own K/V."""
    block_size = data.draw(st.sampled_from([1, 2, 4]), label="block_size")
    num_blocks = data.draw(st.integers(2, 12), label="num_blocks")
    pool = Pool(impl.BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching))
    pool.check()
    tokens = st.integers(1, 3)
    for step in range(data.draw(st.integers(1, 40), label="operations")):
        ops = ["admit"]
        ready = [s for s in pool.running if room_for_last_token(pool.bm, s)]
        if ready:
            ops += ["compute", "compute", "finish", "preempt"]
        if pool.preempted:
            ops.append("recompute")
        op = data.draw(st.sampled_from(ops), label=f"op {step}")
        if op == "admit":
            opening = data.draw(st.sampled_from(OPENINGS), label="opening")
            tail = data.draw(st.lists(tokens, max_size=6), label="tail")
            prompt = list(opening) + tail or [1]
            pool.admit(new_seq(f"r{pool.count}", prompt))
            pool.count += 1
        elif op == "recompute":
            seq = pool.preempted[0]
            if pool.admit(seq):
                pool.preempted.pop(0)
        else:
            seq = data.draw(st.sampled_from(ready), label="sequence")
            if op == "compute":
                pool.compute(seq, data.draw(st.integers(1, 8), label="chunk"),
                             data.draw(tokens, label="sampled"))
            else:
                pool.release(seq, preempt=op == "preempt")
    for seq in list(pool.running):
        pool.release(seq, preempt=False)
    assert pool.bm.num_free_blocks == num_blocks
    assert all(block.ref_count == 0 for block in pool.bm.blocks)
