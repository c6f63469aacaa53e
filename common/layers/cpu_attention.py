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

Left out: prefill (several query tokens per sequence; the reference runs
it), storing K/V (the reference's index_copy_), explicit SIMD intrinsics
(the compiler vectorizes the loops over head_dim), splitting one long
context over several threads.
"""
from __future__ import annotations

import functools

from common.layers import cpp_extensions
from common.layers.attention import TorchOps


def build_extension():
    """The compiled kernel's Python module (built on first use)."""
    return cpp_extensions.build("paged_attention_cpu")


class CpuOps(TorchOps):
    """The reference's store and prefill, with decode attention in C++."""

    @staticmethod
    def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale):
        """Same arguments and result as attention.paged_decode_attention."""
        return build_extension().paged_decode_attention(query, k_cache, v_cache, block_tables,
                                                        context_lens, scale)


@functools.cache
def cpu_attention_ops() -> type[TorchOps]:
    """CpuOps where the kernel builds; else the PyTorch reference, said once."""
    return cpp_extensions.kernels_or_reference(build_extension, CpuOps, TorchOps,
                                               "decode attention")
