"""Attention over a paged KV cache, in plain PyTorch (ch03-04).

The cache of one layer is two tensors `(num_blocks, block_size, num_kv_heads,
head_dim)`; flattened, slot `s` = block `s // block_size`, offset
`s % block_size`. Three operations, one interface (the Triton versions in
common/layers/triton_kernels.py take the same arguments and are used on CUDA;
on the CPU, decode attention runs in C++: common/layers/cpu_attention.py):

1. `store_kvcache`: write the new tokens' K/V at their `slot_mapping`.
2. `paged_decode_attention`: one query token per sequence, over its
   `context_lens[i]` cached tokens found through `block_tables[i]`.
3. `paged_prefill_attention`: several new query tokens per sequence, causal,
   whose earlier context may already sit in the cache (prefix caching,
   chunked prefill, recompute after preemption).

`paged_attention` runs them for one layer's flat batch. From chapter 05,
when the step's decodes all begin with the same blocks (a shared prompt,
found by common/layers/cascade_attention.py), it cascades: the shared
prefix once for all of them, each suffix on its own, the two parts merged
by their log-sum-exps (`cascade_attention`, `merge_attn_states`).

Grouped-query attention: query head `h` reads KV head `h // (H / H_kv)`.
Chapter 03 uses these with `block_size = max_model_len` (one contiguous
region per sequence); chapter 04 with small blocks. Same code.

Left out: sliding windows, ALiBi, soft-capping, FP8 caches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where a flat batch's tokens go and what they attend to.

    The batch holds `num_seqs` sequences' new tokens back to back:
    sequence i's tokens are rows `query_start_loc[i]:query_start_loc[i+1]`.
    The first `num_decodes` sequences have exactly one new token (decode),
    the others several (prefill or a prefill chunk).
    """
    slot_mapping: torch.Tensor  # (num_tokens,) int64: cache slot of each new token
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32: cumulative query lengths
    context_lens: torch.Tensor  # (num_seqs,) int32: cached + new tokens per sequence
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32, padded with 0
    num_decodes: int  # sequences at the front with one new token
    block_size: int
    # ch05: blocks at the front of every decode's table that are the same
    # blocks (a shared prompt); > 0: cascade attention (cascade_attention.py)
    num_common_prefix_blocks: int = 0


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value: (num_tokens, num_kv_heads, head_dim).
    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim)."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    # cache.view(-1, H_kv, D)[slot_mapping] = key, written as a row copy (the
    # slots are distinct): cheaper on the CPU than advanced-index assignment.
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_slots(block_tables: torch.Tensor, num_positions: int, block_size: int) -> torch.Tensor:
    """Cache slot of positions 0..num_positions-1 for every sequence.
    block_tables: (num_seqs, max_blocks) -> (num_seqs, num_positions)."""
    positions = torch.arange(num_positions, device=block_tables.device)
    blocks = block_tables[:, positions // block_size].long()  # (num_seqs, num_positions)
    return blocks * block_size + positions % block_size


def gather_kv(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The K (or V) rows at `slots`, copied out of the cache.
    cache: (num_blocks, block_size, H_kv, D); slots: any shape S -> (*S, H_kv, D).

    One `index_select` over the cache seen as a table of slot rows: the same
    values as `cache.view(-1, H_kv, D)[slots]`, several times faster on the CPU
    (advanced indexing handles any index; index_select copies whole rows)."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    rows = cache.view(-1, num_kv_heads * head_dim)  # (num_slots, H_kv * D)
    picked = rows.index_select(0, slots.reshape(-1))  # (S.numel(), H_kv * D)
    return picked.view(*slots.shape, num_kv_heads, head_dim)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """query: (num_seqs, num_heads, head_dim), one token per sequence, whose
    own K/V are already stored. Returns (num_seqs, num_heads, head_dim)."""
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    max_len = int(context_lens.max())
    # The whole batch at once: every sequence's context, padded to max_len.
    slots = gather_slots(block_tables, max_len, k_cache.shape[1])  # (num_seqs, max_len)
    keys = gather_kv(k_cache, slots)  # (num_seqs, max_len, H_kv, D)
    values = gather_kv(v_cache, slots)
    valid = torch.arange(max_len, device=query.device)[None, :] < context_lens[:, None]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # (num_seqs, H, 1, D)
        keys.transpose(1, 2), values.transpose(1, 2),  # (num_seqs, H_kv, max_len, D)
        attn_mask=valid[:, None, None, :], scale=scale,
        enable_gqa=num_heads != num_kv_heads)
    return out.squeeze(2)


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """query: (num_tokens, num_heads, head_dim), the new tokens of each
    sequence, which are the *last* tokens of its context (their K/V already
    stored). Causal. Returns (num_tokens, num_heads, head_dim)."""
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, context_len in enumerate(context_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        query_len = end - start
        slots = gather_slots(block_tables[i:i + 1], context_len, k_cache.shape[1])
        keys = gather_kv(k_cache, slots)  # (1, context_len, H_kv, D)
        values = gather_kv(v_cache, slots)
        # Query j sits at position context_len - query_len + j: it sees keys 0..that.
        q_pos = torch.arange(context_len - query_len, context_len, device=query.device)
        causal = torch.arange(context_len, device=query.device)[None, :] <= q_pos[:, None]
        # A batch of one: SDPA's fused (flash) CPU kernel wants 4-D inputs.
        out[start:end] = F.scaled_dot_product_attention(
            query[None, start:end].transpose(1, 2),  # (1, H, query_len, D)
            keys.transpose(1, 2), values.transpose(1, 2),  # (1, H_kv, context_len, D)
            attn_mask=causal, scale=scale,
            enable_gqa=num_heads != num_kv_heads)[0].transpose(0, 1)
    return out


def merge_attn_states(prefix_out: torch.Tensor, prefix_lse: torch.Tensor,
                      suffix_out: torch.Tensor, suffix_lse: torch.Tensor) -> torch.Tensor:
    """Two parts of one softmax attention -> the whole (ch05, vLLM's name).
    *_out: (S, H, D), each normalized over its own keys; *_lse: (S, H)."""
    lse = torch.logaddexp(prefix_lse, suffix_lse)  # (S, H): over all the keys
    prefix_weight = (prefix_lse - lse).exp()[..., None]  # (S, H, 1): the prefix's share
    suffix_weight = (suffix_lse - lse).exp()[..., None]
    merged = prefix_out.float() * prefix_weight + suffix_out.float() * suffix_weight
    return merged.to(prefix_out.dtype)


def cascade_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, context_lens: torch.Tensor,
                      num_common_blocks: int, scale: float, ops) -> torch.Tensor:
    """Decode attention for sequences whose first `num_common_blocks` blocks
    are the same (ch05): the same arguments and result as
    `paged_decode_attention`. `ops`: where the kernels of the two parts
    and of their merge are (`shared_prefix_attention`,
    `paged_decode_attention_lse`, `merge_attn_states`; the reference of the
    first two: common/layers/cascade_attention.py, of the third: above)."""
    prefix_len = num_common_blocks * k_cache.shape[1]
    prefix_out, prefix_lse = ops.shared_prefix_attention(
        query, k_cache, v_cache, block_tables[0, :num_common_blocks], scale)
    suffix_out, suffix_lse = ops.paged_decode_attention_lse(
        query, k_cache, v_cache, block_tables[:, num_common_blocks:],
        context_lens - prefix_len, scale)
    return ops.merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, ops) -> torch.Tensor:
    """One layer's attention for a flat batch: store the new K/V, then attend.

    query: (num_tokens, H, D); key, value: (num_tokens, H_kv, D).
    `ops`: the three operations (`attention_selector.attention_ops_for`
    picks them: the Triton kernels on CUDA, decode attention in C++ on the
    CPU; an exercise may bring its own). Returns (num_tokens, H, D).
    """
    ops.store_kvcache(key, value, k_cache, v_cache, meta.slot_mapping)
    d = meta.num_decodes  # rows 0..d-1: one token each, batched together
    if d == query.shape[0]:
        return decode_attention(query, k_cache, v_cache, meta, scale, ops)
    out = torch.empty_like(query)
    if d > 0:
        out[:d] = decode_attention(query[:d], k_cache, v_cache, meta, scale, ops)
    out[d:] = ops.paged_prefill_attention(query[d:], k_cache, v_cache, meta.block_tables[d:],
                                          meta.query_start_loc[d:] - d,
                                          meta.context_lens[d:], scale)
    return out


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, ops) -> torch.Tensor:
    """The step's decodes, query: (num_decodes, H, D): cascaded where they
    share a prefix (ch05), else each over its own context."""
    d = meta.num_decodes
    if meta.num_common_prefix_blocks:  # ch05: the shared prefix read once
        return cascade_attention(query, k_cache, v_cache, meta.block_tables[:d],
                                 meta.context_lens[:d], meta.num_common_prefix_blocks,
                                 scale, ops)
    return ops.paged_decode_attention(query, k_cache, v_cache, meta.block_tables[:d],
                                      meta.context_lens[:d], scale)


class TorchOps:
    """The PyTorch reference, as one object with the three operations."""
    store_kvcache = staticmethod(store_kvcache)
    paged_decode_attention = staticmethod(paged_decode_attention)
    paged_prefill_attention = staticmethod(paged_prefill_attention)
