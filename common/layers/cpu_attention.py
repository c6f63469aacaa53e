"""Attention on the CPU that reads the paged cache in place, in C++ (ch04).

The PyTorch reference (attention.py) first copies every sequence's whole
context out of the cache (`gather_kv`), padded to the longest, then runs a
masked SDPA over the copy: for every layer at every step, the cache's bytes
move three times, and with an explicit mask SDPA computes the scores of
the masked keys too. vLLM's CPU backend reads the blocks where they are,
in C++. So do the two kernels here:

- decode (csrc/paged_attention_cpu.cpp): one query token per sequence.
  Each context is walked a tile of up to 32 tokens of one block at a time
  (the next tile prefetched), with an online softmax, in float32; each K
  and V row is read once through the block table and serves its group's
  query heads. Where one context is more than a thread's share of the
  batch's keys, the contexts longer than 512 tokens are cut into pieces
  that run on different threads and are merged at the end
  (flash-decoding), so that a few long contexts keep both cores busy. A decode step of 64
  sequences in bfloat16: 1.29x faster than with the reference, 1.19x in
  float32 (bench/results/2026-12-02-vm-profile.md).
- prefill (csrc/prefill_attention_cpu.cpp): several new tokens per
  sequence, causal, after whatever the cache already holds (a prefix hit,
  an earlier chunk). Flash attention's way: a tile of 32 new tokens x the
  query heads of one KV head against 64 keys at a time, staged from their
  blocks, scores and values as small register-tiled products, an online
  softmax; the keys a tile's rows cannot see are never read.
  bench/profiles/prefill_attention.py times it against the reference.
- cascade attention's two parts (ch05, common/layers/cascade_attention.py):
  the prefill kernel's tiles with every decode query against one shared
  prefix, and the decode kernel over each suffix, both also returning each
  head's log-sum-exp.

One exception: in bfloat16 on a CPU with AMX, SDPA's products run on
oneDNN's AMX tiles, and the reference beats the tiled kernel's float32
loops once a chunk is long (the kernel: 0.52-0.92x there; still 1.2x
where 16 sequences each add 30 tokens after a 1,000-token prefix, as the
reference's setup is per sequence). So on such a CPU, a bfloat16 chunk of
at least `AMX_MIN_QUERY` new tokens whose query length x context length is
above `AMX_CHUNK` goes to the reference
(bench/results/2026-12-06-vm-prefill-attention.md).

PyTorch compiles both on first use (common/layers/cpp_extensions.py; `make
setup` does it once). Where they cannot be built, `cpu_attention_ops` says
why and the engine runs the PyTorch reference. A head_dim other than 64 or
128 prefills through the reference (the tiles are compiled for those two).

The reference stays the specification: tests/test_cpu_attention.py checks
both kernels against it (float32 and bfloat16, grouped and not, blocks of
1 to a whole region; short, long, chunked prompts and prefix hits) and the
engine's greedy tokens against HF's through them.

Left out: storing K/V (the reference's index_copy_), explicit SIMD
intrinsics and AMX tiles (the compiler vectorizes the loops, in float32).
"""
from __future__ import annotations

import functools

import torch

from common.layers import cascade_attention, cpp_extensions
from common.layers.attention import TorchOps
from common.loader import cpu_bf16_flags

TILED_HEAD_DIMS = (64, 128)  # the head sizes the prefill kernel is compiled for
# In bfloat16 on a CPU with AMX, a chunk of at least AMX_MIN_QUERY new tokens
# and above AMX_CHUNK (query length x context length) is faster through the
# reference's SDPA (see the module's docstring).
AMX_MIN_QUERY = 64
AMX_CHUNK = 128 * 128


@functools.cache
def cpu_has_amx() -> bool:
    return "amx_bf16" in cpu_bf16_flags()


def to_the_reference(query: torch.Tensor, query_start_loc: torch.Tensor,
                     context_lens: torch.Tensor) -> torch.Tensor | None:
    """Which sequences of a prefill batch go to the reference (a (S,) mask),
    or None: all of them to the tiled kernel."""
    if query.shape[-1] not in TILED_HEAD_DIMS:
        return torch.ones_like(context_lens, dtype=torch.bool)
    if query.dtype != torch.bfloat16 or not cpu_has_amx():
        return None
    query_lens = query_start_loc.diff()  # (S,)
    long = (query_lens >= AMX_MIN_QUERY) & (query_lens * context_lens > AMX_CHUNK)  # (S,)
    return long if long.any() else None


def build_extension():
    """The decode kernel's Python module (built on first use)."""
    return cpp_extensions.build("paged_attention_cpu")


def build_prefill_extension():
    """The prefill kernel's Python module (built on first use)."""
    return cpp_extensions.build("prefill_attention_cpu")


def build_extensions():
    """Both kernels (what `cpu_attention_ops` checks before using them)."""
    return build_extension(), build_prefill_extension()


class CpuOps(TorchOps):
    """The reference's store; decode and prefill attention in C++; and the
    two parts of cascade attention (ch05, common/layers/cascade_attention.py)."""

    @staticmethod
    def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale):
        """Same arguments and result as attention.paged_decode_attention."""
        return build_extension().paged_decode_attention(query, k_cache, v_cache, block_tables,
                                                        context_lens, scale)

    @staticmethod
    def paged_decode_attention_lse(query, k_cache, v_cache, block_tables, context_lens, scale):
        """Cascade's suffix: the decode kernel, with each head's log-sum-exp."""
        return build_extension().paged_decode_attention_lse(query, k_cache, v_cache,
                                                            block_tables, context_lens, scale)

    @staticmethod
    def merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse):
        """Cascade's merge (attention.merge_attn_states), one loop in C++."""
        return build_extension().merge_attn_states(prefix_out, prefix_lse, suffix_out,
                                                   suffix_lse)

    @staticmethod
    def shared_prefix_attention(query, k_cache, v_cache, prefix_blocks, scale):
        """Cascade's prefix: the prefill kernel's tiles, every query against
        the same blocks, no mask; with each head's log-sum-exp."""
        if query.shape[-1] not in TILED_HEAD_DIMS:
            return cascade_attention.shared_prefix_attention(query, k_cache, v_cache,
                                                             prefix_blocks, scale)
        return build_prefill_extension().shared_prefix_attention(query, k_cache, v_cache,
                                                                 prefix_blocks, scale)

    @staticmethod
    def paged_prefill_attention(query, k_cache, v_cache, block_tables, query_start_loc,
                                context_lens, scale):
        """Same arguments and result as attention.paged_prefill_attention:
        the tiled kernel, or the reference for the sequences `to_the_reference` picks."""
        tiled = build_prefill_extension().paged_prefill_attention
        reference = TorchOps.paged_prefill_attention
        picked = to_the_reference(query, query_start_loc, context_lens)  # (S,) or None
        if picked is None or picked.all():  # one way for the whole batch: one call
            attend = tiled if picked is None else reference
            return attend(query, k_cache, v_cache, block_tables, query_start_loc,
                          context_lens, scale)
        out = torch.empty_like(query)
        query_lens = query_start_loc.diff()  # (S,)
        picked_rows = picked.repeat_interleave(query_lens.long())  # (T,)
        for seqs, rows, attend in ((~picked, ~picked_rows, tiled),
                                   (picked, picked_rows, reference)):
            lens = query_lens[seqs]
            loc = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(query_start_loc.dtype)
            out[rows] = attend(query[rows], k_cache, v_cache, block_tables[seqs], loc,
                               context_lens[seqs], scale)
        return out


@functools.cache
def cpu_attention_ops() -> type[TorchOps]:
    """CpuOps where the kernels build; else the PyTorch reference, said once."""
    return cpp_extensions.kernels_or_reference(build_extensions, CpuOps, TorchOps,
                                               "attention")
