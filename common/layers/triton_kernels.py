"""Paged attention as Triton kernels (ch04).

The same three operations as the PyTorch reference in common/layers/attention.py,
with the same names, arguments and results; attention.py calls these on
CUDA (`attention_ops_for`). Each is a `@triton.jit` kernel plus a thin Python
wrapper that checks the inputs, picks the grid and launches it:

1. `store_kvcache`: one program per new token copies its K and V rows
   into the cache at `slot_mapping[token]`.
2. `paged_decode_attention`: one program per (sequence, KV head) walks
   the sequence's blocks through `block_tables` with the query heads that
   share that KV head (grouped-query attention: Llama-3-8B's 32 query heads
   share 8 KV heads, four each), and keeps an *online softmax* (running
   max, running sum, running weighted sum of V) for each of them, so the
   whole context never has to sit in memory at once and each block of K/V
   is read once, not once per query head. For long contexts and few
   sequences, *split-K* (flash-decoding) cuts each context into partitions
   of PARTITION_SIZE tokens, one program each, and a second kernel merges
   their partial softmaxes.
3. `paged_prefill_attention`: one program per (sequence, KV head, tile of
   the sequence's new tokens): the same walk, causal, with matrix products
   (`tl.dot`) for the tile's tokens times the group's query heads at once.

Where a token lives: the cache of one layer is `(num_blocks, block_size,
num_kv_heads, head_dim)`; token `i` of sequence `s` sits in physical block
`block_tables[s, i // block_size]` at offset `i % block_size`.

The kernels walk the context in *tiles* of TILE_N = 16 positions. With the
course's block size 16, a tile is exactly one block: the loop is "for each
block of the sequence". Smaller blocks (1, 2, 4, 8) are packed several to a
tile, because `tl.dot` wants at least 16 rows; larger blocks (chapter 03
uses `block_size = max_model_len`, which need not be a power of two) are read
16 positions at a time. To allow all of these, a kernel looks up the physical
block of *each position* of a tile (a gather from `block_tables`); when a
tile is one block, those lookups all read the same entry. vLLM's Triton
"unified attention" kernel does the same. (Tiles of 16 also keep every
kernel within the registers of one GPU core: bigger tiles spilled.)

Numerics: scores, softmax and the output are accumulated in float32; the
result is cast back to the query's dtype. float32 inputs use exact float32
matrix products (`input_precision="ieee"`, not TF32), so they match the
reference to ~1e-6.

Runs on the CPU too, slowly, under the Triton interpreter: set
`TRITON_INTERPRET=1` in the environment before triton is first imported
(triton's own `tl.sum`, `tl.zeros`... are `@triton.jit` functions too) and
pass CPU tensors; tests/test_triton_kernels.py does that. The interpreter
cannot multiply bfloat16 matrices (it multiplies their bit patterns), so
on the CPU only float32 (and float16) can be checked; bfloat16 on a GPU.

Left out, on purpose: FP8 or quantized caches, sliding windows, ALiBi,
soft-capping, autotuning of tile sizes, a persistent kernel that balances
uneven contexts across programs, and negative "padding" slots in
`slot_mapping` (the reference has none either).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tile sizes, in tokens. Both attention kernels read the context TILE_N
# positions at a time (16: one block of the course's block size, and tl.dot's
# smallest operand). A prefill program has PREFILL_ROWS rows of queries (its
# new tokens times the query heads of one KV head: 64 tokens of one head, or
# 16 tokens of a group of four) and PREFILL_NUM_WARPS warps (8 * 32 threads:
# with 4 warps, float32 at head_dim 128 ran out of registers, as Triton's
# compiler for H100/H200 reported). A split-K decode program reads
# PARTITION_SIZE positions of one context (vLLM's paged_attention_v2 uses 512).
TILE_N = 16
PREFILL_ROWS = 64
PREFILL_NUM_WARPS = 8
PARTITION_SIZE = 512


# --------------------------------------------------------------------------
# 1. store_kvcache: write the new tokens' K and V into their cache slots
# --------------------------------------------------------------------------

@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr,  # (num_tokens, num_kv_heads, head_dim)
    k_cache_ptr, v_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping_ptr,  # (num_tokens,)
    key_stride_token, key_stride_head, key_stride_dim,
    value_stride_token, value_stride_head, value_stride_dim,
    cache_stride_block, cache_stride_offset, cache_stride_head, cache_stride_dim,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr,
    KV_HEADS_PADDED: tl.constexpr,  # num_kv_heads rounded up to a power of two
    HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0)  # one program per new token
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: big caches
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    # The token's rows for all KV heads at once: a (KV_HEADS_PADDED, HEAD_DIM)
    # tile. tl.arange needs a power of two, so heads are padded and masked
    # (SmolLM2 has 3 KV heads: the tile has 4 rows, the last one masked).
    heads = tl.arange(0, KV_HEADS_PADDED)[:, None]  # (KV_HEADS_PADDED, 1)
    dims = tl.arange(0, HEAD_DIM)[None, :]  # (1, HEAD_DIM)
    mask = heads < num_kv_heads  # (KV_HEADS_PADDED, 1)
    if slot >= 0:  # slot -1: a padding row of a CUDA graph's batch (ch05), nothing to write
        k = tl.load(key_ptr + token * key_stride_token + heads * key_stride_head
                    + dims * key_stride_dim, mask=mask)  # (KV_HEADS_PADDED, HEAD_DIM)
        v = tl.load(value_ptr + token * value_stride_token + heads * value_stride_head
                    + dims * value_stride_dim, mask=mask)
        cache_offsets = (block * cache_stride_block + offset * cache_stride_offset
                         + heads * cache_stride_head + dims * cache_stride_dim)
        # tl.store casts to the cache's dtype, like the reference's assignment.
        tl.store(k_cache_ptr + cache_offsets, k, mask=mask)
        tl.store(v_cache_ptr + cache_offsets, v, mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value: (num_tokens, num_kv_heads, head_dim).
    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim), written
    in place at `slot_mapping` (num_tokens,)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    _check_head_dim(head_dim)
    _check_same_layout(k_cache, v_cache)
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    slot_mapping = slot_mapping.contiguous()  # the kernel indexes it with stride 1
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(),
        num_kv_heads,
        BLOCK_SIZE=block_size,
        KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
    )


# --------------------------------------------------------------------------
# Shared by both attention kernels: where the K/V rows of a tile of
# positions are, through the sequence's block table, and one step of the
# online softmax over that tile.
# --------------------------------------------------------------------------

@triton.jit
def _kv_tile_offsets(
    block_table_ptr,  # this sequence's row of block_tables: (max_blocks,)
    positions,  # (TILE_N,) token positions in the sequence
    in_context,  # (TILE_N,) which of them exist
    kv_head,
    cache_stride_block, cache_stride_offset, cache_stride_head, cache_stride_dim,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Offsets of the K (or V) rows of `positions`: (TILE_N, HEAD_DIM)."""
    # Logical block -> physical block, one lookup per position. When the tile
    # is exactly one block all these loads read the same entry of the table.
    logical_block = positions // BLOCK_SIZE  # (TILE_N,)
    physical_block = tl.load(block_table_ptr + logical_block, mask=in_context, other=0)
    physical_block = physical_block.to(tl.int64)  # int64: big caches overflow int32
    offset_in_block = positions % BLOCK_SIZE  # (TILE_N,)
    dims = tl.arange(0, HEAD_DIM)
    return (physical_block[:, None] * cache_stride_block
            + offset_in_block[:, None] * cache_stride_offset
            + kv_head * cache_stride_head
            + dims[None, :] * cache_stride_dim)  # (TILE_N, HEAD_DIM)


@triton.jit
def _attend_tile(
    q,  # (ROWS, HEAD_DIM): one query per row
    k_cache_ptr, v_cache_ptr,
    kv_offsets,  # (TILE_N, HEAD_DIM) where the tile's K/V rows are (_kv_tile_offsets)
    in_context,  # (TILE_N,) which positions of the tile exist
    visible,  # (ROWS, TILE_N) or (1, TILE_N): which positions each row may see
    scale,
    running_max, running_sum,  # (ROWS,) float32: the online softmax's state...
    acc,  # (ROWS, HEAD_DIM) float32: ...and the running weighted sum of V
    DOT_PRECISION: tl.constexpr,
):
    """One step of the online softmax, for every row at once: both attention
    kernels' loop body. Returns the new (running_max, running_sum, acc)."""
    # b) load the tile's keys once; score them for every row.
    k = tl.load(k_cache_ptr + kv_offsets, mask=in_context[:, None], other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # (ROWS, TILE_N)
    scores = tl.where(visible, scores, -float("inf"))

    # c) online softmax: if this tile holds a larger score, everything
    #    summed so far was scaled by exp(-old_max) and must now be scaled
    #    by exp(-new_max): multiply it by alpha = exp(old_max - new_max).
    #    Each row sees a position of its first tile (a partition's first
    #    position, or position 0), so new_max is finite from then on.
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))  # (ROWS,)
    alpha = tl.exp(running_max - new_max)  # 0 on the first tile
    p = tl.exp(scores - new_max[:, None])  # (ROWS, TILE_N) unnormalised probabilities
    running_sum = running_sum * alpha + tl.sum(p, axis=1)

    # d) load the tile's values once; acc += p @ V. p is cast to the cache
    #    dtype for the matrix product (bfloat16 on GPU, as FlashAttention does).
    v = tl.load(v_cache_ptr + kv_offsets, mask=in_context[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return new_max, running_sum, acc


# --------------------------------------------------------------------------
# 2. paged_decode_attention: one new token per sequence
# --------------------------------------------------------------------------

@triton.jit
def _paged_decode_kernel(
    out_ptr,  # (num_seqs, num_heads, head_dim); split-K: (num_seqs, num_heads, splits, head_dim)
    lse_ptr,  # split-K only: (num_seqs, num_heads, splits), each split's log-sum-exp
    query_ptr,  # (num_seqs, num_heads, head_dim)
    k_cache_ptr, v_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim)
    block_tables_ptr,  # (num_seqs, max_blocks)
    context_lens_ptr,  # (num_seqs,)
    scale,
    query_stride_seq, query_stride_head, query_stride_dim,
    out_stride_seq, out_stride_head, out_stride_split, out_stride_dim,
    lse_stride_seq, lse_stride_head, lse_stride_split,
    cache_stride_block, cache_stride_offset, cache_stride_head, cache_stride_dim,
    block_tables_stride_seq,
    QUERIES_PER_KV: tl.constexpr,  # num_heads // num_kv_heads (GQA group size)
    GROUP_ROWS: tl.constexpr,  # QUERIES_PER_KV padded to a power of two >= 16 (tl.dot)
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,  # context positions per program (split-K), a multiple of TILE_N
    SPLIT_K: tl.constexpr,  # False: one partition covers the context, write the output
    DOT_PRECISION: tl.constexpr,
):
    # One program per (sequence, KV head, partition of the context). The
    # query heads that share the KV head are the rows of one (GROUP_ROWS,
    # HEAD_DIM) query tile, so each K/V tile is loaded once for all of them.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)  # cached tokens, own one included
    block_table_ptr = block_tables_ptr + seq * block_tables_stride_seq
    if SPLIT_K:  # this program's partition of the context
        split_start = split * PARTITION_SIZE
        split_end = tl.minimum(split_start + PARTITION_SIZE, context_len)
    else:  # the whole context
        split_start = 0
        split_end = context_len

    rows = tl.arange(0, GROUP_ROWS)  # (GROUP_ROWS,) the group's query heads, padded
    heads = kv_head * QUERIES_PER_KV + rows
    row_valid = rows < QUERIES_PER_KV
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(query_ptr + seq * query_stride_seq + heads[:, None] * query_stride_head
                + dims[None, :] * query_stride_dim,
                mask=row_valid[:, None], other=0.0)  # (GROUP_ROWS, HEAD_DIM)

    # Online softmax state (float32), one row per query head: the largest
    # score seen so far, the sum of exp(score - running_max), and the sum of
    # exp(score - running_max) * V.
    running_max = tl.full([GROUP_ROWS], -float("inf"), dtype=tl.float32)
    running_sum = tl.zeros([GROUP_ROWS], dtype=tl.float32)
    acc = tl.zeros([GROUP_ROWS, HEAD_DIM], dtype=tl.float32)  # (GROUP_ROWS, HEAD_DIM)

    # The loop over this partition of the context, one tile (= one block at
    # block_size 16) per step.
    for tile_start in range(split_start, split_end, TILE_N):
        # a) positions of this tile, and the physical block of each
        #    (loaded from block_tables inside _kv_tile_offsets).
        positions = tile_start + tl.arange(0, TILE_N)  # (TILE_N,)
        in_context = positions < split_end  # the last tile may be partial
        kv_offsets = _kv_tile_offsets(
            block_table_ptr, positions, in_context, kv_head,
            cache_stride_block, cache_stride_offset, cache_stride_head, cache_stride_dim,
            BLOCK_SIZE, HEAD_DIM)  # (TILE_N, HEAD_DIM)

        # b)-d) the online softmax's step for every head of the group
        running_max, running_sum, acc = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, kv_offsets, in_context, in_context[None, :], scale,
            running_max, running_sum, acc, DOT_PRECISION)  # acc: (GROUP_ROWS, HEAD_DIM)

    out_offsets = (seq * out_stride_seq + heads[:, None] * out_stride_head
                   + split * out_stride_split + dims[None, :] * out_stride_dim)
    if SPLIT_K:
        # This partition's softmax over its own positions, and its
        # log-sum-exp, for _merge_splits_kernel. A partition past the end of
        # a short context saw nothing: weight exp(-inf) = 0 in the merge.
        saw_tokens = running_sum > 0
        safe_sum = tl.where(saw_tokens, running_sum, 1.0)
        lse = tl.where(saw_tokens, running_max + tl.log(safe_sum), -float("inf"))
        out = acc / safe_sum[:, None]
        tl.store(lse_ptr + seq * lse_stride_seq + heads * lse_stride_head
                 + split * lse_stride_split, lse, mask=row_valid)
    else:
        out = acc / running_sum[:, None]  # softmax(scores) @ V
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # (num_seqs, num_heads, head_dim)
    partial_out_ptr,  # (num_seqs, num_heads, splits, head_dim) float32
    lse_ptr,  # (num_seqs, num_heads, splits) float32
    num_splits,
    out_stride_seq, out_stride_head, out_stride_dim,
    partial_stride_seq, partial_stride_head, partial_stride_split, partial_stride_dim,
    lse_stride_seq, lse_stride_head, lse_stride_split,
    SPLITS_PADDED: tl.constexpr,  # num_splits rounded up to a power of two
    HEAD_DIM: tl.constexpr,
):
    # One program per (sequence, query head). The partition with the largest
    # log-sum-exp gets weight 1, the others exp(their lse - that one's), so
    # the weighted sum of the partial outputs is the softmax over the whole
    # context (merge_attn_states in attention.py does the same for two parts).
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PADDED)  # (SPLITS_PADDED,)
    valid = splits < num_splits
    lse = tl.load(lse_ptr + seq * lse_stride_seq + head * lse_stride_head
                  + splits * lse_stride_split, mask=valid, other=-float("inf"))
    weights = tl.exp(lse - tl.max(lse, axis=0))  # (SPLITS_PADDED,) 0 where a split saw nothing
    dims = tl.arange(0, HEAD_DIM)
    partial = tl.load(partial_out_ptr + seq * partial_stride_seq + head * partial_stride_head
                      + splits[:, None] * partial_stride_split + dims[None, :] * partial_stride_dim,
                      mask=valid[:, None], other=0.0)  # (SPLITS_PADDED, HEAD_DIM)
    out = tl.sum(partial * weights[:, None], axis=0) / tl.sum(weights, axis=0)  # (HEAD_DIM,)
    tl.store(out_ptr + seq * out_stride_seq + head * out_stride_head + dims * out_stride_dim,
             out.to(out_ptr.dtype.element_ty))


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int,
                      multiprocessors: int, partition_size: int = PARTITION_SIZE) -> int:
    """How many partitions split-K cuts each context into: 1 (no split-K)
    while the (sequence, KV head) programs are enough to give every
    multiprocessor of the GPU one; else one per PARTITION_SIZE tokens of the
    longest possible context, so that a few long sequences still keep the
    whole GPU busy. (vLLM's paged_attention_v1/v2 choice is of this kind.)"""
    if num_seqs * num_kv_heads >= multiprocessors:
        return 1
    return max(1, triton.cdiv(max_context, partition_size))


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, num_splits: int | None = None,
                           partition_size: int = PARTITION_SIZE) -> torch.Tensor:
    """query: (num_seqs, num_heads, head_dim), one token per sequence, whose
    own K/V are already stored. Returns (num_seqs, num_heads, head_dim).

    `num_splits`: partitions per context (split-K); None picks it with
    `decode_num_splits` from the shapes alone (no host sync, so a CUDA graph
    can capture it: the block table's width bounds every context). A
    partition that starts past a sequence's context returns at once."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    _check_attention_inputs(query, k_cache, v_cache, block_tables)
    assert partition_size % TILE_N == 0, f"partition_size must be a multiple of {TILE_N}"
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    max_context = block_tables.shape[1] * block_size  # no sequence is longer
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_context,
                                       multiprocessors(query.device), partition_size)
    split_k = num_splits > 1
    # The kernel indexes these with stride 1 along their last dimension.
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    queries_per_kv = num_heads // num_kv_heads
    if split_k:  # each partition's output and log-sum-exp, in float32, then merged
        partial_out = torch.empty(num_seqs, num_heads, num_splits, head_dim,
                                  dtype=torch.float32, device=query.device)
        lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                          device=query.device)
        out_strides, lse_strides = partial_out.stride(), lse.stride()
    else:  # the output itself, with a split stride of 0
        partial_out, lse = out, out
        out_strides, lse_strides = (*out.stride()[:2], 0, out.stride(2)), (0, 0, 0)
    grid = (num_seqs, num_kv_heads, num_splits)  # one program per (sequence, KV head, partition)
    _paged_decode_kernel[grid](
        partial_out, lse, query, k_cache, v_cache, block_tables, context_lens, float(scale),
        *query.stride(), *out_strides, *lse_strides, *k_cache.stride(), block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        GROUP_ROWS=max(16, triton.next_power_of_2(queries_per_kv)),
        BLOCK_SIZE=block_size,
        TILE_N=TILE_N,
        HEAD_DIM=head_dim,
        PARTITION_SIZE=partition_size,
        SPLIT_K=split_k,
        DOT_PRECISION=_dot_precision(query.dtype),
    )
    if split_k:
        _merge_splits_kernel[(num_seqs, num_heads)](
            out, partial_out, lse, num_splits,
            *out.stride(), *partial_out.stride(), *lse.stride(),
            SPLITS_PADDED=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
        )
    return out


# --------------------------------------------------------------------------
# 3. paged_prefill_attention: several new tokens per sequence, causal
# --------------------------------------------------------------------------

@triton.jit
def _paged_prefill_kernel(
    out_ptr,  # (num_tokens, num_heads, head_dim)
    query_ptr,  # (num_tokens, num_heads, head_dim)
    k_cache_ptr, v_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim)
    block_tables_ptr,  # (num_seqs, max_blocks)
    query_start_loc_ptr,  # (num_seqs + 1,)
    context_lens_ptr,  # (num_seqs,)
    scale,
    query_stride_token, query_stride_head, query_stride_dim,
    out_stride_token, out_stride_head, out_stride_dim,
    cache_stride_block, cache_stride_offset, cache_stride_head, cache_stride_dim,
    block_tables_stride_seq,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_ROWS: tl.constexpr,  # QUERIES_PER_KV rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # new tokens per program
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,  # context positions per loop step
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (exact), else default
):
    # One program per (sequence, KV head, tile of BLOCK_Q new tokens). Its
    # BLOCK_Q * GROUP_ROWS rows are every (token, query head of the group)
    # pair, token-major: row r is token r // GROUP_ROWS, head r % GROUP_ROWS
    # of the group. Each K/V tile is loaded once for all of them.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)

    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if q_tile * BLOCK_Q >= query_len:
        return  # the grid is sized for the longest query; this one is shorter
    context_len = tl.load(context_lens_ptr + seq)  # cached + new tokens
    block_table_ptr = block_tables_ptr + seq * block_tables_stride_seq

    # The new tokens are the *last* query_len of the context: new token j
    # sits at position context_len - query_len + j.
    rows = tl.arange(0, BLOCK_Q * GROUP_ROWS)  # (M,) M = BLOCK_Q * GROUP_ROWS
    q_index = q_tile * BLOCK_Q + rows // GROUP_ROWS  # (M,) j within the sequence
    head_in_group = rows % GROUP_ROWS
    heads = kv_head * QUERIES_PER_KV + head_in_group  # (M,)
    row_valid = (q_index < query_len) & (head_in_group < QUERIES_PER_KV)
    q_positions = context_len - query_len + q_index  # (M,)
    dims = tl.arange(0, HEAD_DIM)
    q_offsets = ((query_start + q_index)[:, None] * query_stride_token
                 + heads[:, None] * query_stride_head + dims[None, :] * query_stride_dim)
    q = tl.load(query_ptr + q_offsets, mask=row_valid[:, None], other=0.0)  # (M, HEAD_DIM)

    # Online softmax state, one row per (token, head).
    running_max = tl.full([BLOCK_Q * GROUP_ROWS], -float("inf"), dtype=tl.float32)  # (M,)
    running_sum = tl.zeros([BLOCK_Q * GROUP_ROWS], dtype=tl.float32)  # (M,)
    acc = tl.zeros([BLOCK_Q * GROUP_ROWS, HEAD_DIM], dtype=tl.float32)  # (M, HEAD_DIM)

    # Causal: the last token of this tile sees positions 0..its own, so the
    # loop stops there: positions after it are masked for every row anyway.
    last_q_index = tl.minimum((q_tile + 1) * BLOCK_Q, query_len) - 1
    context_end = context_len - query_len + last_q_index + 1

    for tile_start in range(0, context_end, TILE_N):
        # a) positions of this tile, and the physical block of each.
        positions = tile_start + tl.arange(0, TILE_N)  # (TILE_N,)
        in_context = positions < context_end
        kv_offsets = _kv_tile_offsets(
            block_table_ptr, positions, in_context, kv_head,
            cache_stride_block, cache_stride_offset, cache_stride_head, cache_stride_dim,
            BLOCK_SIZE, HEAD_DIM)  # (TILE_N, HEAD_DIM)

        # b)-d) the online softmax's step for every (token, head) row, causal
        visible = in_context[None, :] & (positions[None, :] <= q_positions[:, None])
        running_max, running_sum, acc = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, kv_offsets, in_context, visible, scale,
            running_max, running_sum, acc, DOT_PRECISION)  # acc: (M, HEAD_DIM)

    out = acc / running_sum[:, None]  # (M, HEAD_DIM)
    out_offsets = ((query_start + q_index)[:, None] * out_stride_token
                   + heads[:, None] * out_stride_head + dims[None, :] * out_stride_dim)
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """query: (num_tokens, num_heads, head_dim), the new tokens of each
    sequence, which are the *last* tokens of its context (their K/V already
    stored). Causal. Returns (num_tokens, num_heads, head_dim)."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = context_lens.shape[0]
    _check_attention_inputs(query, k_cache, v_cache, block_tables)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    query_start_loc = query_start_loc.contiguous()
    queries_per_kv = num_heads // num_kv_heads
    group_rows = triton.next_power_of_2(queries_per_kv)
    assert group_rows <= PREFILL_ROWS, f"more than {PREFILL_ROWS} query heads per KV head"
    block_q = PREFILL_ROWS // group_rows  # 64 tokens with one head a group, 16 with four
    # The grid must cover the longest query (one host sync, as in the reference).
    max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _paged_prefill_kernel[grid](
        out, query, k_cache, v_cache, block_tables, query_start_loc, context_lens,
        float(scale),
        *query.stride(), *out.stride(), *k_cache.stride(), block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        GROUP_ROWS=group_rows,
        BLOCK_Q=block_q,
        BLOCK_SIZE=block_size,
        TILE_N=TILE_N,
        HEAD_DIM=head_dim,
        DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=PREFILL_NUM_WARPS,
    )
    return out


# --------------------------------------------------------------------------
# Helpers of the wrappers
# --------------------------------------------------------------------------

def multiprocessors(device: torch.device) -> int:
    """The GPU's streaming multiprocessors (132 on an H100); 1 elsewhere (the
    interpreter), where split-K runs only when asked for."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _dot_precision(dtype: torch.dtype) -> str:
    # float32: exact products, not TF32 (so float32 runs match the reference).
    # bfloat16/float16: the tensor cores' native products ("tf32" is the
    # default name of that setting; it only changes float32 inputs).
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_head_dim(head_dim: int) -> None:
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, (
        f"the Triton kernels need head_dim to be a power of two >= 16 (tl.arange "
        f"and tl.dot sizes); got head_dim={head_dim}. Use the PyTorch reference "
        f"in common/layers/attention.py for this model.")


def _check_same_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    # The kernels take one set of cache strides for both K and V.
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), (
        f"k_cache and v_cache must have the same shape and strides; got "
        f"{tuple(k_cache.shape)}/{k_cache.stride()} and "
        f"{tuple(v_cache.shape)}/{v_cache.stride()}")


def _check_attention_inputs(query: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, block_tables: torch.Tensor) -> None:
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    _check_head_dim(head_dim)
    _check_same_layout(k_cache, v_cache)
    assert k_cache.shape[3] == head_dim, (
        f"query head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    assert num_heads % num_kv_heads == 0, (
        f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    assert query.dtype == k_cache.dtype, (
        f"query ({query.dtype}) and KV cache ({k_cache.dtype}) must share a dtype")
    assert block_tables.dim() == 2, "block_tables must be (num_seqs, max_blocks)"
