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

from common.engine.sequence import Sequence


def compute_block_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The name of a full block: depends on every token before it too."""
    return hash((prev_hash, token_ids))


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
    def _block_hashes(self, token_ids: list[int]) -> list[tuple[int, tuple[int, ...]]]:
        """(hash, tokens) of every full block of `token_ids`."""
        hashes, prev = [], None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            tokens = tuple(token_ids[start:start + self.block_size])
            prev = compute_block_hash(prev, tokens)
            hashes.append((prev, tokens))
        return hashes

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix we may reuse for `seq`.

        At least one token must still be computed to get logits, so when the
        whole prompt is cached the last block is recomputed (as vLLM does).
        """
        if not self.enable_prefix_caching:
            return []
        hits = []
        for block_hash, tokens in self._block_hashes(seq.token_ids):
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break  # a miss, or a hash collision caught by the token check
            hits.append(block_id)
        max_reusable = (seq.num_tokens - 1) // self.block_size
        return hits[:max_reusable]

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
            self.prefix_queries += len(self._block_hashes(seq.prompt_token_ids))
            self.prefix_hits += len(cached)
        for block_id in cached:
            self._reuse(block_id)
        seq.block_table = list(cached)
        for _ in range(self.blocks_needed(seq.num_tokens) - len(cached)):
            seq.block_table.append(self._take_free_block().block_id)
        seq.num_computed_tokens = len(cached) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens

    def can_append(self, seq: Sequence) -> bool:
        """Room for one more token: a free block only if the last is full."""
        has_room = seq.num_tokens <= len(seq.block_table) * self.block_size
        return has_room or self.num_free_blocks > 0

    def may_append(self, seq: Sequence) -> None:
        """Make room for seq's newest token (a new block when the last is full)."""
        if seq.num_tokens > len(seq.block_table) * self.block_size:
            seq.block_table.append(self._take_free_block().block_id)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        hashes = self._block_hashes(seq.token_ids[:num_full * self.block_size])
        for block_id, (block_hash, tokens) in zip(seq.block_table, hashes):
            block = self.blocks[block_id]
            if block.hash is None:
                block.hash, block.token_ids = block_hash, tokens
                self.hash_to_block.setdefault(block_hash, block_id)

    def deallocate(self, seq: Sequence) -> None:
        """Give back seq's blocks (a shared block stays until its last user)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0

    # ------------------------------------------------------- accounting
    def usage(self, seqs: list[Sequence]) -> dict:
        """Slots reserved (blocks in use x block size) vs slots holding a
        token, counting a shared block once."""
        filled: dict[int, int] = {}
        for seq in seqs:
            for j, block_id in enumerate(seq.block_table):
                tokens = min(self.block_size, max(0, seq.num_computed_tokens - j * self.block_size))
                filled[block_id] = max(filled.get(block_id, 0), tokens)
        reserved = self.num_used_blocks * self.block_size
        used = sum(filled.values())
        return {"num_blocks": self.num_blocks, "used_blocks": self.num_used_blocks,
                "reserved_slots": reserved, "used_slots": used,
                "usage_perc": 100.0 * self.num_used_blocks / self.num_blocks,
                "waste_perc": 100.0 * (reserved - used) / reserved if reserved else 0.0}
