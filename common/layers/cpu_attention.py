"""Decode attention on the CPU that reads the paged cache in place (ch04).

The PyTorch reference (attention.py) first copies every sequence's whole
context out of the cache (`gather_kv`), padded to the longest, then runs a
masked SDPA over the copy: for every layer at every step, the cache's bytes
move three times, and SDPA's kernel, made for long queries, pays its own
setup for one query token per sequence. vLLM's CPU backend reads the blocks
where they are, in C++. So does csrc/paged_attention_cpu.cpp: the sequences
in parallel over the intra-op threads, each context walked a tile of up to
32 tokens of one block at a time (the next tile prefetched), with an online
softmax, all in float32; each K and V row is read once through the block
table and serves its group's query heads. A decode step of 64 sequences in
bfloat16: 1.29x faster than with the reference, 1.19x in float32
(bench/results/2026-12-02-vm-profile.md).

PyTorch compiles it on first use (common/layers/cpp_extensions.py; `make
setup` does it once). Where it cannot be built, `cpu_attention_ops` says why
and the engine runs the PyTorch reference.

The reference stays the specification: tests/test_cpu_attention.py checks
the kernel against it (float32 and bfloat16, grouped and not, blocks of 1 to
a whole region) and the engine's greedy tokens against HF's through it.

Prefill (issue 35): a short chunk's new tokens go through the same kernel,
each as a decode row that sees the keys up to its own position (exactly
the causal mask). For the load test's 32-36-token prompts, one layer's
prefill attention takes 2.8-3.3x less time than the reference's
per-sequence loop, 1.1-1.6x less at 64 tokens; a long chunk (query length
x context length above SHORT_CHUNK) still goes through the reference,
since each row reads its whole context again (0.1-0.7x there):
bench/results/2026-12-04-vm-prefill-attention.md.

Left out: a prefill kernel that reads each K/V tile once for many query
rows (what long prompts would need), storing K/V (the reference's index_copy_), explicit SIMD intrinsics
(the compiler vectorizes the loops over head_dim), splitting one long
context over several threads.
"""
from __future__ import annotations

import functools

import torch

from common.layers import cpp_extensions
from common.layers.attention import TorchOps


def build_extension():
    """The compiled kernel's Python module (built on first use)."""
    return cpp_extensions.build("paged_attention_cpu")


# A prefill chunk goes through the kernel, as decode rows, while its query
# length x context length is at most this; above, the reference's SDPA
# (bench/profiles/prefill_attention.py measures both).
SHORT_CHUNK = 64 * 64


def prefill_as_decode_rows(query, k_cache, v_cache, block_tables, query_start_loc,
                           context_lens, scale):
    """Causal prefill attention through the decode kernel: the new token j
    of a sequence (position context_len - query_len + j) is one decode row
    that sees the first context_len - query_len + j + 1 tokens of the same
    block table. Exactly the causal mask; each row reads its context in
    place, so the work grows with query_len x context_len (SHORT_CHUNK)."""
    query_lens = query_start_loc.diff().long()  # (S,)
    seq_of_row = torch.repeat_interleave(
        torch.arange(len(query_lens), device=query.device), query_lens)  # (T,)
    index = torch.arange(query.shape[0], device=query.device) - query_start_loc[seq_of_row]
    seen = (context_lens - query_lens)[seq_of_row] + index + 1  # (T,) keys each row sees
    return build_extension().paged_decode_attention(
        query, k_cache, v_cache, block_tables[seq_of_row], seen.to(torch.int32), scale)


class CpuOps(TorchOps):
    """The reference's store; decode attention in C++, and the short prefill
    chunks (the usual prompts) through the same kernel."""

    @staticmethod
    def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale):
        """Same arguments and result as attention.paged_decode_attention."""
        return build_extension().paged_decode_attention(query, k_cache, v_cache, block_tables,
                                                        context_lens, scale)

    @staticmethod
    def paged_prefill_attention(query, k_cache, v_cache, block_tables, query_start_loc,
                                context_lens, scale):
        """Same arguments and result as attention.paged_prefill_attention
        (issue 35): short chunks as decode rows, the long ones (a long
        prompt's chunks) through the reference."""
        query_lens = query_start_loc.diff()  # (S,)
        short = query_lens * context_lens <= SHORT_CHUNK  # (S,)
        if short.all() or not short.any():  # one kind of chunk: the whole batch in one call
            attend = prefill_as_decode_rows if short.all() else TorchOps.paged_prefill_attention
            return attend(query, k_cache, v_cache, block_tables, query_start_loc,
                          context_lens, scale)
        out = torch.empty_like(query)
        short_rows = short.repeat_interleave(query_lens.long())  # (T,)
        for seqs, rows, attend in ((short, short_rows, prefill_as_decode_rows),
                                   (~short, ~short_rows, TorchOps.paged_prefill_attention)):
            lens = query_lens[seqs]
            loc = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(query_start_loc.dtype)
            out[rows] = attend(query[rows], k_cache, v_cache, block_tables[seqs], loc,
                               context_lens[seqs], scale)
        return out


@functools.cache
def cpu_attention_ops() -> type[TorchOps]:
    """CpuOps where the kernel builds; else the PyTorch reference, said once."""
    return cpp_extensions.kernels_or_reference(build_extension, CpuOps, TorchOps,
                                               "decode attention")
