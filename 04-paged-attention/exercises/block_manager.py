"""Exercise 04: the block manager, the bookkeeping of PagedAttention.

You write the class that hands out the KV cache in blocks of `block_size`
tokens: a free list, one block table per sequence (logical block ->
physical block, like an OS page table), ref counts for shared blocks, and
prefix caching (full blocks named by chained hashes and reused by the
next prompt that starts with the same tokens).

The engine builds it as `BlockManager(num_blocks, block_size,
enable_prefix_caching)`; the scheduler calls `can_allocate` / `allocate`
to admit a sequence, `can_append` / `may_append` before each decode
step, `cache_full_blocks` after each step and `deallocate` when a
sequence finishes or is preempted. The model runner only reads
`seq.block_table`. Token `i` of a sequence lives at slot
`block_table[i // block_size] * block_size + i % block_size`.

Graded by `make exercise CH=04` (the tests marked `ex04` in
tests/test_ch04_paged.py, tests/test_block_manager_invariants.py,
tests/test_scheduler_invariants.py, tests/test_ch03_kv_cache.py and
tests/test_ch05_scheduler.py), which build the real engine with your
class too. exercises/README.md has the
tasks in order and the hints; a failing test names the hint to read
first. Once every test passes, compare your class with
common/core/block_manager.py, the one the servers run.

Given: `Block`, `KVCacheUsage` (what `usage` returns), the constructor's
state, `_block_tokens`. Left out, as in the course's class: swapping
blocks to CPU memory, copy-on-write (beam search), sliding-window blocks.

Left out on purpose, although the course's class has them: the
`num_lookahead_tokens` argument of `can_append` and `may_append` (room
for draft tokens after the newest one) and `free_blocks_past_end` (giving
back the blocks that only rejected drafts used). Both serve chapter 07's
speculative decoding, which comes later; the tests that grade this
exercise never pass drafts, and chapter 07 runs the course's class.

Which fields of a `Sequence` (common/core/sequence.py) you write:
`block_table`, `num_computed_tokens` (only in `allocate`, to the cached
prefix, and in `deallocate`, back to 0: the scheduler advances it after
each step), `num_cached_tokens`, `block_hashes`, `num_registered_blocks`.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from common.core.block_manager import KVCacheUsage
from common.core.sequence import Sequence


def compute_block_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The name of a full block: a hash of the previous block's hash and of
    this block's token ids, so that it depends on every token before it.

    Call it by its name from your methods (`compute_block_hash(...)`), not
    through a saved copy: two tests replace it (one forces collisions,
    one counts the calls).
    """
    # Hint: Python's built-in hash() of a tuple is enough here.
    raise NotImplementedError("compute_block_hash: return a hash of (prev_hash, token_ids)")


@dataclass
class Block:
    block_id: int
    ref_count: int = 0  # how many sequences have this block in their block table
    hash: int | None = None  # set once the block is full, computed and registered
    token_ids: tuple[int, ...] = field(default_factory=tuple)  # its tokens, once registered


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]  # the tests read .ref_count
        # The free list, oldest freed first (popitem(last=False) takes the
        # oldest). An OrderedDict rather than a list: with prefix caching a
        # free block that is still cached can be taken out of the middle,
        # in O(1) (`del self.free_blocks[block_id]`).
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}  # prefix cache: block hash -> block id
        self.prefix_queries = 0  # full prompt blocks looked up in the prefix cache
        self.prefix_hits = 0  # ... and found there
        # Add any state you need (the reference keeps one more counter).

    # ------------------------------------------------------------- sizes
    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens (rounded up)."""
        raise NotImplementedError("blocks_needed: num_tokens / block_size, rounded up")

    @property
    def num_free_blocks(self) -> int:
        raise NotImplementedError("num_free_blocks: how many blocks are in the free list")

    @property
    def num_used_blocks(self) -> int:
        raise NotImplementedError("num_used_blocks: the blocks that are not free")

    # ------------------------------------------------------ prefix cache
    def _block_tokens(self, seq: Sequence, j: int) -> tuple[int, ...]:
        """The token ids of seq's block number j."""
        return tuple(seq.token_ids[j * self.block_size:(j + 1) * self.block_size])

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix we may reuse for `seq`.

        Walk seq's full blocks in order and stop at the first one that is
        not in `hash_to_block`. At least one token must still be computed
        to get logits, so when the whole prompt is cached the last block is
        recomputed (as vLLM does): never reuse the block that holds the
        sequence's last token. A hit counts only if the cached block's
        token ids are seq's own (a hash collision must never hand out
        someone else's K/V).

        `seq.block_hashes` keeps the hashes of seq's full blocks: each block
        is hashed once in the sequence's life (a test counts the calls).
        """
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []  # ch06: prompt logprobs need every prompt token's logits (vLLM's rule)
        # Stuck? exercises/README.md, hints 5, 6 and 7.
        raise NotImplementedError("_cached_prefix: the block ids of seq's cached prefix")

    # ------------------------------------------------------- the API
    def can_allocate(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        """Enough free blocks for `num_tokens` (default: all of seq's tokens)?

        A cached prefix block that another sequence is using costs no free
        block; a cached block that is free still does (it leaves the free list).
        """
        raise NotImplementedError("can_allocate: compare the blocks needed with the free ones")

    def allocate(self, seq: Sequence) -> None:
        """Blocks for all of seq's tokens; cached prefix blocks are shared.

        Sets `seq.block_table`, `seq.num_computed_tokens` and
        `seq.num_cached_tokens` (the tokens found in the prefix cache, 0
        without it) and `seq.num_registered_blocks` (the blocks already in
        the prefix cache). With prefix caching on, counts the full prompt
        blocks looked up (`prefix_queries`) and found (`prefix_hits`).
        """
        # A fresh block comes from the front of the free list. Stuck on the
        # blocks of a cache hit, or on a fresh block that still carries an old
        # hash? exercises/README.md, hints 8, 9 and 11.
        raise NotImplementedError("allocate: reuse the cached prefix, then take free blocks")

    def can_append(self, seq: Sequence) -> bool:
        """Room for seq's newest token: a free block is needed only if the
        last block is full."""
        raise NotImplementedError("can_append: room in the last block, or a free block")

    def may_append(self, seq: Sequence) -> None:
        """Make room for seq's newest token (a new block when the last is full)."""
        raise NotImplementedError("may_append: append a free block when seq outgrew its table")

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register in the prefix cache the blocks that are now full AND
        computed (K/V written): the first `seq.num_computed_tokens //
        block_size` blocks. Each block is registered once, when it fills;
        `seq.num_registered_blocks` says how many already are."""
        if not self.enable_prefix_caching:
            return
        # Stuck? exercises/README.md, hint 10.
        raise NotImplementedError("cache_full_blocks: set hash and token_ids of new full blocks")

    def deallocate(self, seq: Sequence) -> None:
        """Give back seq's blocks: ref count - 1, and a block whose count
        reaches 0 goes back to the free list (keeping its hash and tokens:
        a later prompt may still hit it). Resets seq's block table,
        `num_computed_tokens` and `num_registered_blocks`; keeps
        `block_hashes` (the tokens did not change)."""
        # Stuck? exercises/README.md, hint 3.
        raise NotImplementedError("deallocate: drop seq's references, free unused blocks")

    # ------------------------------------------------------- accounting
    def usage(self, seqs: list[Sequence]) -> KVCacheUsage:
        """KV slots reserved (blocks in use x block size) against slots that
        hold a computed token, for the running sequences `seqs`. A block
        shared by several sequences is counted once, in both figures.

        Returns a `KVCacheUsage(num_blocks, used_blocks, reserved_slots,
        used_slots, usage_perc, waste_perc)` (percentages 0-100;
        waste_perc = 100 x (reserved - used) / reserved, 0 when nothing
        is reserved). The engine calls it after every step for /stats.
        """
        # Stuck? exercises/README.md, hint 4.
        raise NotImplementedError("usage: reserved and used slots, and the waste")
