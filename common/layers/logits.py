"""The LM head (ch03): the last hidden states -> one row of logits each.

Left out: vLLM's LogitsProcessor (soft-capping, scaling, logits of a
vocabulary split over ranks: common/layers/parallel.py gathers those).
"""
from __future__ import annotations

import functools

import torch

from common.layers.cpu_gemm import Gemm, OneDnnLinear, dense_gemm, packs_weights


def lm_head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden: (N, hidden), weight: (vocab, hidden) -> logits (N, vocab).

    F.linear(hidden, weight), written as weight @ hidden.T: the head is the
    largest matrix product of a decode step (49,152 x 576 for SmolLM2), and
    on the CPU the BLAS (MKL) is faster with the big matrix on the left,
    read in its own row order: a quarter faster at 32 rows, several times
    faster at 2-9 rows (measured on a 2-core AMD EPYC, torch 2.13).
    Same dot products; the sums may round differently in the last bits
    (as F.linear's own results already vary with the number of rows)."""
    return (weight @ hidden.T).T.contiguous()  # (vocab, N) -> (N, vocab)


def lm_head_gemm(weight: torch.Tensor, tied: bool = False) -> Gemm:
    """The head as one callable, hidden (N, hidden) -> logits (N, vocab):
    ch05: on a CPU, with the weight packed once for oneDNN (cpu_gemm.py; in
    bfloat16 at 64 rows the head took 11.1 ms before, 4.0 ms now:
    bench/results/2026-12-02-vm-profile-before.md, -profile.md); else
    `lm_head`.

    A head `tied` to the embedding keeps its plain weight (the embedding
    reads its rows), so its packed copy is a second one: in bfloat16 it is
    packed all the same; in float32 (SmolLM2's copy would cost 113 MB, and
    chapter 03's demo card would have no room left for its one region)
    oneDNN reads the plain weight (`OneDnnLinear`)."""
    plain = functools.partial(lm_head, weight=weight)
    if tied and weight.dtype == torch.float32 and packs_weights(weight):
        return OneDnnLinear(weight)
    return dense_gemm(weight, unpacked=plain)
