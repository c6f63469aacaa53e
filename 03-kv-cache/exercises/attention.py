"""Exercise 03: attention through the KV cache.

Our forward pass (common/models/llama.py, gpt2.py) calls three operations in
every layer: store the new tokens' K and V in the cache, then let each query
attend over its sequence's cached tokens. You write those three:

1. `store_kvcache`: write K/V of the new tokens at their `slot_mapping`.
2. `paged_decode_attention`: one new token per sequence (decode) attends
   over all `context_lens[i]` tokens of its sequence.
3. `paged_prefill_attention`: several new tokens per sequence (a prompt, or
   the rest of one), causal: each sees the tokens before it and itself.

The cache of one layer is two tensors (num_blocks, block_size, num_kv_heads,
head_dim). Seen flat, as (num_blocks * block_size, num_kv_heads, head_dim),
row s is *slot* s: block s // block_size, offset s % block_size. Position p
of sequence i lives in slot

    block_tables[i, p // block_size] * block_size + p % block_size

Chapter 03 gives each sequence one block of max_model_len slots (a
contiguous region: block_tables[i] = [region], and slot = region *
block_size + p). Chapter 04 cuts the same memory into blocks of 16 tokens;
the same three functions serve it unchanged, and one grading test checks
both (`test_paged_equals_contiguous_and_hf`). Write them for any block size.

Graded by `make exercise CH=03`: the tests marked `ex03` in
tests/test_ch03_kv_cache.py and tests/test_ch04_paged.py build the forward
pass and the whole engine with your three functions as its attention, and
compare against attention written out with a softmax, against HF's logits,
and against HF `model.generate`'s greedy tokens.

exercises/README.md has the hints; a failing test names the hint to read
first. Once every test passes, compare your functions with
common/layers/attention.py (plain PyTorch, what the engine runs on the
CPU beside a C++ decode kernel); the Triton kernels of
common/layers/triton_kernels.py have the same interface (chapter 04).

Left out on purpose: speed (a loop over sequences is fine here; the
course's functions do the whole batch at once, with `gather_slots` and
`gather_kv`), the online softmax of the Triton kernels. Given, not
written here: `paged_attention` and `AttentionMetadata` in
common/layers/attention.py, which split a step's flat batch into decodes
and prefills and call your three functions. Left out of both: sliding
windows, ALiBi, soft-capping, FP8 caches.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: F401  (F.scaled_dot_product_attention is allowed)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write the new tokens' K and V into their cache slots, in place.

    key, value: (num_tokens, num_kv_heads, head_dim), one row per new token.
    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim).
    slot_mapping: (num_tokens,) int64, the slot of each new token (all
        different).

    Returns nothing: after the call, slot slot_mapping[t] of k_cache holds
    key[t] (and the same for v_cache and value).
    """
    # Stuck? exercises/README.md, hint 1.
    raise NotImplementedError(
        "store_kvcache: view the caches as (num_slots, num_kv_heads, head_dim) and write "
        "key[t], value[t] at row slot_mapping[t]")


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Decode: one query token per sequence, over its whole cached context.

    query: (num_seqs, num_heads, head_dim), the new token of each sequence,
        whose own K/V are already stored (it attends to itself too).
    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim).
    block_tables: (num_seqs, max_blocks) int32, padded with 0 after a
        sequence's last block.
    context_lens: (num_seqs,) int32, tokens in each sequence's cache, the
        new one included: sequence i reads positions 0..context_lens[i]-1.
    scale: multiply the scores q . k by it (head_dim ** -0.5).

    Returns (num_seqs, num_heads, head_dim), in query's dtype.

    Grouped-query attention: num_heads may be a multiple of num_kv_heads;
    query head h reads KV head h // (num_heads // num_kv_heads).
    """
    # Stuck? exercises/README.md, hints 1 to 3.
    raise NotImplementedError(
        "paged_decode_attention: for each sequence, gather its context_lens[i] keys and "
        "values through block_tables[i], then softmax(q . k * scale) @ v for each head")


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Prefill: several new tokens per sequence, causal.

    query: (num_tokens, num_heads, head_dim): the new tokens of all the
        sequences, back to back; sequence i's are rows
        query_start_loc[i]:query_start_loc[i+1].
    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim), the
        new tokens' K/V already stored.
    block_tables: (num_seqs, max_blocks) int32, padded with 0.
    query_start_loc: (num_seqs + 1,) int32, cumulative query lengths,
        starting at 0.
    context_lens: (num_seqs,) int32, cached + new tokens of each sequence.
        The new tokens are the *last* ones of the context: with q_len new
        tokens and n = context_lens[i], query row j sits at position
        n - q_len + j. (Usually n == q_len, a whole prompt; n > q_len when
        earlier tokens are already cached: prefix caching, chunked prefill.)
    scale: multiply the scores by it.

    Causal: the query at position p sees keys at positions 0..p, never later.
    Returns (num_tokens, num_heads, head_dim), in query's dtype.
    """
    # Stuck? exercises/README.md, hint 4.
    raise NotImplementedError(
        "paged_prefill_attention: for each sequence, gather its context through "
        "block_tables[i] and attend causally: query j (position n - q_len + j) sees keys 0..that")
