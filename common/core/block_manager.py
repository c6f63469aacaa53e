"""BlockManager: the KV cache cut into fixed-size blocks (ch04).

Like an operating system's pages: each sequence owns a *block table*, the
list of physical blocks that hold its tokens in order; token `i` lives in
block `block_table[i // block_size]` at offset `i % block_size`, i.e. at
slot `block_id * block_size + offset` of the cache tensor. Blocks are handed
out from a free list on demand, so a sequence wastes less than one block.

Chapter 03's contiguous cache is this same class with `block_size =
max_model_len`: one block per sequence, reserved whole at admission.

Prefix caching (`--enable-prefix-caching`, ch04): a *full* block is named by
a hash chained over the previous block's hash and its own token ids. A new
prompt that starts with cached blocks reuses them (ref count + 1) and only
prefills the rest. A hit is confirmed by comparing the token ids, so a hash
collision can never hand out the wrong K/V. A block is registered only once
its K/V are computed, and freed blocks keep their hash until the block is
handed out again (lazy eviction, oldest freed first).

Left out: swapping blocks to CPU memory, copy-on-write for beam search,
sliding-window blocks.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from common.core.sequence import Sequence


def compute_block_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The name of a full block: depends on every token before it too."""
    return hash((prev_hash, token_ids))


@dataclass(frozen=True)
class KVCacheUsage:
    """The cache's figures after a step (`usage()`), for /stats and the log."""
    num_blocks: int
    used_blocks: int
    reserved_slots: int  # blocks in use x block size
    used_slots: int  # slots that hold a computed token (a shared block counted once)
    usage_perc: float  # 100 x used blocks / blocks
    waste_perc: float  # 100 x (reserved - used) / reserved; 0 when nothing is reserved


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and computed
    token_ids: tuple[int, ...] = field(default_factory=tuple)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, oldest freed first; an OrderedDict so that a cached
        # free block can be taken out of the middle in O(1).
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.num_shared_refs = 0  # sum over blocks of (ref_count - 1): for usage()
        self.prefix_queries = 0  # full prompt blocks looked up
        self.prefix_hits = 0  # ... and found

    # ------------------------------------------------------------- sizes
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    # ------------------------------------------------------ prefix cache
    def _full_block_hashes(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Hashes of the full blocks among seq's first `num_tokens` tokens.
        Each block is hashed once in the sequence's life, when first asked
        for (`seq.block_hashes` keeps them, even across a preemption)."""
        num_full = num_tokens // self.block_size
        while len(seq.block_hashes) < num_full:
            j = len(seq.block_hashes)
            # ch10: the first block's parent is the adapter, so an adapter's
            # blocks are its own (0, the base model, keeps None: unchanged)
            prev = seq.block_hashes[-1] if j else (seq.lora_int_id or None)
            seq.block_hashes.append(compute_block_hash(prev, self._block_tokens(seq, j)))
        return seq.block_hashes[:num_full]

    def _block_tokens(self, seq: Sequence, j: int) -> tuple[int, ...]:
        """The token ids of seq's block number j."""
        return tuple(seq.token_ids[j * self.block_size:(j + 1) * self.block_size])

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix we may reuse for `seq`.

        At least one token must still be computed to get logits, so when the
        whole prompt is cached the last block is recomputed (as vLLM does).
        """
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []  # ch06: prompt logprobs need every prompt token's logits (vLLM's rule)
        hits = []
        max_reusable = (seq.num_tokens - 1) // self.block_size
        for j, block_hash in enumerate(self._full_block_hashes(seq, seq.num_tokens)):
            block_id = self.hash_to_block.get(block_hash)
            if j == max_reusable or block_id is None:
                break
            if self.blocks[block_id].token_ids != self._block_tokens(seq, j):
                break  # a hash collision, caught by the token check
            hits.append(block_id)
        return hits

    def _take_free_block(self) -> Block:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # evict its old contents
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block

    def _reuse(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        else:
            self.num_shared_refs += 1  # one more sequence reads this full block
        block.ref_count += 1

    # ------------------------------------------------------- the API
    def can_allocate(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        """Enough free blocks for `num_tokens` (default: all of seq's tokens)?"""
        needed = self.blocks_needed(num_tokens or seq.num_tokens)
        cached = self._cached_prefix(seq)
        in_use = sum(1 for b in cached if self.blocks[b].ref_count > 0)
        return needed - in_use <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Blocks for all of seq's tokens; cached prefix blocks are shared.
        Sets `seq.num_computed_tokens` to the tokens found in the cache."""
        assert not seq.block_table, "sequence already has blocks"
        cached = self._cached_prefix(seq)
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_prompt_tokens // self.block_size
            self.prefix_hits += len(cached)
        for block_id in cached:
            self._reuse(block_id)
        seq.block_table = list(cached)
        for _ in range(self.blocks_needed(seq.num_tokens) - len(cached)):
            seq.block_table.append(self._take_free_block().block_id)
        seq.num_computed_tokens = len(cached) * self.block_size  # writer: admission
        seq.num_cached_tokens = seq.num_computed_tokens
        seq.num_registered_blocks = len(cached)  # already in the prefix cache

    def can_append(self, seq: Sequence, num_lookahead_tokens: int = 0) -> bool:
        """Room for seq's newest token (a free block only if the last is
        full), and ch07 for `num_lookahead_tokens` draft tokens after it."""
        missing = self.blocks_needed(seq.num_tokens + num_lookahead_tokens) - len(seq.block_table)
        return missing <= self.num_free_blocks

    def may_append(self, seq: Sequence, num_lookahead_tokens: int = 0) -> None:
        """Make room for seq's newest token (a new block when the last is
        full), and ch07 for `num_lookahead_tokens` draft tokens after it."""
        while len(seq.block_table) < self.blocks_needed(seq.num_tokens + num_lookahead_tokens):
            seq.block_table.append(self._take_free_block().block_id)

    def free_blocks_past_end(self, seq: Sequence) -> None:
        """ch07: give back the blocks that only rejected drafts used (past
        the block of seq's last token). Never shared, never cached: a block
        is cached once full of computed tokens, and these hold none."""
        while len(seq.block_table) > self.blocks_needed(seq.num_tokens):
            self._release(seq.block_table.pop())

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that this step filled (full and computed) in
        the prefix cache. Each block is registered once, when it fills."""
        if not self.enable_prefix_caching:
            return
        hashes = self._full_block_hashes(seq, seq.num_computed_tokens)
        for j in range(seq.num_registered_blocks, len(hashes)):
            block = self.blocks[seq.block_table[j]]
            if block.hash is None:
                block.hash, block.token_ids = hashes[j], self._block_tokens(seq, j)
                self.hash_to_block.setdefault(hashes[j], block.block_id)
        seq.num_registered_blocks = len(hashes)

    def deallocate(self, seq: Sequence) -> None:
        """Give back seq's blocks (a shared block stays until its last user)."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0  # writer: preemption or finish (the K/V are gone)
        seq.num_registered_blocks = 0

    def _release(self, block_id: int) -> None:
        """One reader fewer: the block goes back to the free list once it
        has none (a shared block stays)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks[block_id] = None
        else:
            self.num_shared_refs -= 1

    # ------------------------------------------------------- accounting
    def usage(self, seqs: list[Sequence]) -> KVCacheUsage:
        """Slots reserved (blocks in use x block size) vs slots holding a
        computed token, counting a shared block once. O(number of seqs):
        a shared block is a full cached block, counted once per reader in
        the sum of `num_computed_tokens`."""
        reserved = self.num_used_blocks * self.block_size
        used = (sum(seq.num_computed_tokens for seq in seqs)
                - self.num_shared_refs * self.block_size)
        return KVCacheUsage(
            num_blocks=self.num_blocks, used_blocks=self.num_used_blocks,
            reserved_slots=reserved, used_slots=used,
            usage_perc=100.0 * self.num_used_blocks / self.num_blocks,
            waste_perc=100.0 * (reserved - used) / reserved if reserved else 0.0)
