"""Cascade attention (ch05): decode sequences that share a prefix read it once.

With prefix caching (chapter 04) on, sequences that began with the same
prompt (a system prompt, a document several users ask about) share that
prompt's KV blocks: their block tables begin with the same block ids.
Plain decode attention still reads those blocks once per sequence: 16
users of one 1,000-token document read its K/V 16 times a layer. Cascade
attention cuts each sequence's attention in two at the end of the shared
part and puts the two results back together:

1. prefix: every decode query against the shared blocks, all at once and
   with no mask (every query comes after the whole prefix): one pass over
   the prefix's K/V for the whole batch, a tile of queries x a tile of
   keys, as prefill attention computes (`shared_prefix_attention`);
2. suffix: each sequence's own blocks after the prefix, by ordinary
   decode attention (`paged_decode_attention_lse`);
3. merge: both parts also return, per query head, the log-sum-exp of
   their scores, `lse = log(sum_j exp(s_j))`, which is what a softmax
   needs to be split and rejoined. The whole softmax's weights are each
   part's, rescaled by `exp(lse_part - lse_all)` (`merge_attn_states`).

vLLM does the same on the GPU (vllm/v1/attention/backends/flash_attn.py:
`use_cascade_attention`, `cascade_attention`, and `merge_attn_states`),
when all running requests share at least 256 tokens and there are at least
8 of them, its thresholds here too; its CPU backend has no cascade.
`--disable-cascade-attn` turns it off (vLLM's flag).

This module: when to cascade (`num_common_prefix_blocks`), and the PyTorch
reference of the two parts, the specification of the C++ kernels'
(common/layers/cpu_attention.py). The cascade itself, `cascade_attention`
and `merge_attn_states`, is in attention.py, which calls it.
tests/test_cpu_attention.py checks the kernels against the reference and
the cascade against plain decode attention.

Left out: prefill chunks in the cascade (only the step's decodes),
a prefix shared by some of the batch rather than all of it, vLLM's cost
model that declines the cascade where the GPU's other path is faster.
"""
from __future__ import annotations

import torch

from common.layers.attention import gather_kv, gather_slots

MIN_COMMON_PREFIX_TOKENS = 256  # vLLM's: a shorter prefix is cheap to read again
MIN_DECODES = 8  # vLLM's: fewer sequences share too little to be worth a second pass


def num_common_prefix_blocks(block_tables: list[list[int]], context_lens: list[int],
                             block_size: int) -> int:
    """How many leading blocks all these decode sequences have in common,
    or 0 below the thresholds. Never a sequence's last block: the one its
    new token was written to, which always leaves a suffix."""
    if len(block_tables) < MIN_DECODES:
        return 0
    first = block_tables[0]
    # whole blocks before each one's last
    limit = min((length - 1) // block_size for length in context_lens)
    common = 0
    while common < limit and all(table[common] == first[common] for table in block_tables):
        common += 1
    return common if common * block_size >= MIN_COMMON_PREFIX_TOKENS else 0


def shared_prefix_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            prefix_blocks: torch.Tensor, scale: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference. query: (S, H, D), one decode token per sequence;
    prefix_blocks: (P,) int32, the blocks every sequence begins with.
    Returns each query's attention over those P * block_size keys, no mask,
    (S, H, D), and its log-sum-exp (S, H) float32."""
    block_size = k_cache.shape[1]
    slots = gather_slots(prefix_blocks[None], len(prefix_blocks) * block_size, block_size)[0]
    keys, values = gather_kv(k_cache, slots), gather_kv(v_cache, slots)  # (L, H_kv, D)
    group = query.shape[1] // k_cache.shape[2]
    keys = keys.repeat_interleave(group, dim=1).float()  # (L, H, D)
    values = values.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("shd,lhd->shl", query.float(), keys) * scale  # (S, H, L)
    lse = scores.logsumexp(-1)  # (S, H)
    out = torch.einsum("shl,lhd->shd", (scores - lse[..., None]).exp(), values)
    return out.to(query.dtype), lse


def paged_decode_attention_lse(query: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, scale: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference. attention.paged_decode_attention's arguments and
    output, and each head's log-sum-exp of its scores, (S, H) float32."""
    block_size, group = k_cache.shape[1], query.shape[1] // k_cache.shape[2]
    max_len = int(context_lens.max())
    slots = gather_slots(block_tables, max_len, block_size)  # (S, L)
    keys = gather_kv(k_cache, slots).repeat_interleave(group, dim=2).float()  # (S, L, H, D)
    values = gather_kv(v_cache, slots).repeat_interleave(group, dim=2).float()
    scores = torch.einsum("shd,slhd->shl", query.float(), keys) * scale  # (S, H, L)
    positions = torch.arange(max_len, device=query.device)
    past_end = positions[None, :] >= context_lens[:, None]  # (S, L)
    scores = scores.masked_fill(past_end[:, None, :], float("-inf"))
    lse = scores.logsumexp(-1)  # (S, H)
    out = torch.einsum("shl,slhd->shd", (scores - lse[..., None]).exp(), values)
    return out.to(query.dtype), lse


CASCADE_OPS = ("shared_prefix_attention", "paged_decode_attention_lse", "merge_attn_states")


def supports_cascade(ops) -> bool:
    """Whether an attention operations set has cascade's three kernels."""
    return all(hasattr(ops, name) for name in CASCADE_OPS)
