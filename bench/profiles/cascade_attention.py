"""Cascade attention on the CPU: decodes sharing a prefix, plain against cascaded.

    python -m bench.profiles.cascade_attention   # about 20 s

Times one layer's decode attention for batches whose sequences all begin
with the same blocks (a shared document, then each sequence's own
question and answer so far), two ways, in one run:

- plain: the decode kernel, each sequence over its whole context (it
  reads the shared blocks once per sequence);
- cascade: `attention.cascade_attention` with the C++ kernels: the
  shared prefix once for every query (the prefill kernel's tiles), each
  suffix through the decode kernel, the two merged by log-sum-exps;
  and, apart, its prefix part alone.

Left out: the rest of the layer, the store of K/V.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.profiles.prefill_attention import (
    BLOCK_SIZE,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    median_ms,
    random_cache,
)
from bench.record import bf16_words, record_head, write_results
from common.layers.attention import cascade_attention
from common.layers.cpu_attention import CpuOps, build_extension

# (sequences, shared prefix, own suffix): the shared-prefix load (16 users of
# one 1,000-token document, halfway through their 128-token answers), the
# same at 64 users, the least prefix that cascades (256 tokens), a long one
SHAPES = [(16, 1008, 94), (64, 1008, 94), (8, 256, 40), (16, 256, 40), (16, 4000, 94)]


def shared_batch(dtype: torch.dtype, seqs: int, prefix_len: int, suffix_len: int) -> tuple:
    """A batch whose block tables begin with the same prefix_len // BLOCK_SIZE blocks."""
    gen = torch.Generator().manual_seed(seqs * prefix_len + suffix_len)
    context_len = prefix_len + suffix_len
    k_cache, v_cache, tables = random_cache(dtype, seqs, context_len, gen)
    common = prefix_len // BLOCK_SIZE
    tables[:, :common] = tables[0, :common].clone()
    query = torch.randn(seqs, HEADS, HEAD_DIM, generator=gen).to(dtype)
    lens = torch.full((seqs,), context_len, dtype=torch.int32)
    return query, k_cache, v_cache, tables, lens, common


def one_shape(dtype: torch.dtype, seqs: int, prefix_len: int, suffix_len: int) -> dict:
    query, k_cache, v_cache, tables, lens, common = shared_batch(dtype, seqs, prefix_len,
                                                                 suffix_len)
    scale = HEAD_DIM ** -0.5
    kernel = build_extension()
    return {"dtype": str(dtype).removeprefix("torch."), "seqs": seqs, "prefix": prefix_len,
            "suffix": suffix_len,
            "plain_ms": median_ms(lambda: kernel.paged_decode_attention(
                query, k_cache, v_cache, tables, lens, scale)),
            "cascade_ms": median_ms(lambda: cascade_attention(
                query, k_cache, v_cache, tables, lens, common, scale, CpuOps)),
            "prefix_ms": median_ms(lambda: CpuOps.shared_prefix_attention(
                query, k_cache, v_cache, tables[0, :common], scale))}


def markdown(rec: dict) -> str:
    m = rec["machine"]
    lines = ["# Cascade attention: decodes that share a prefix, plain and cascaded", "",
             f"Measured {rec['date']} on {m['cpu']} ({m['cores']} cores, {bf16_words(m)}), "
             f"torch {m['torch']}; {rec['seconds']:.0f} s.",
             f"Command: `{rec['command']}`. One layer of the embedded model ({HEADS} query "
             f"heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}), blocks of {BLOCK_SIZE} "
             "tokens scattered at random, every sequence's first blocks the same; "
             "median of 10.", "",
             "| dtype | seqs x (prefix + suffix) | plain ms | cascade ms | of which prefix ms "
             "| plain / cascade |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['seqs']} x ({r['prefix']} + {r['suffix']}) | "
              f"{r['plain_ms']:.3f} | {r['cascade_ms']:.3f} | {r['prefix_ms']:.3f} | "
              f"{r['plain_ms'] / r['cascade_ms']:.2f}x |" for r in rec["runs"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    begin = time.perf_counter()
    runs = [one_shape(dtype, *shape) for dtype in (torch.float32, torch.bfloat16)
            for shape in SHAPES]
    rec = {**record_head("python -m bench.profiles.cascade_attention"), "runs": runs,
           "seconds": time.perf_counter() - begin}
    write_results(args.out_dir, "cascade-attention", rec, markdown(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
