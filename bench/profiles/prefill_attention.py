"""Prefill attention on the CPU: the PyTorch reference against the decode kernel, row by row.

`python -m bench.profiles.prefill_attention` (about 20 s) times one layer's
prefill attention over random paged caches, for chunks of several shapes
(sequences x query length, context length): the reference
(`attention.paged_prefill_attention`: per sequence, gather its K/V out of
the blocks, build the causal mask, run SDPA) against
`cpu_attention.prefill_as_decode_rows` (each new token one decode row of
the C++ kernel, reading the blocks in place). Its results file says where
the second wins, which is how `cpu_attention.SHORT_CHUNK` was chosen; the
engine sends each chunk to the faster of the two by that threshold.

Left out: the store of K/V (the same for both), the rest of the layer.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.record import bf16_words, record_head, write_results
from common.layers.attention import paged_prefill_attention
from common.layers.cpu_attention import SHORT_CHUNK, prefill_as_decode_rows

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16  # the embedded model's layer
# (sequences, query length, context length): the load test's prompts, then longer chunks
SHAPES = [(16, 32, 32), (14, 36, 36), (8, 64, 64), (4, 128, 128), (2, 256, 256),
          (1, 512, 512), (1, 128, 1024), (1, 512, 2048)]


def median_ms(fn, repeats: int = 10) -> float:
    for _ in range(3):  # warm: the first calls allocate
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def one_shape(dtype: torch.dtype, seqs: int, query_len: int, context_len: int) -> dict:
    gen = torch.Generator().manual_seed(seqs * query_len + context_len)
    per_seq = -(-context_len // BLOCK_SIZE)
    num_blocks = seqs * per_seq + 1
    cache_shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:seqs * per_seq].reshape(seqs, per_seq)
    args = (torch.randn(seqs * query_len, HEADS, HEAD_DIM, generator=gen).to(dtype),
            k_cache, v_cache, tables.to(torch.int32),
            torch.arange(seqs + 1, dtype=torch.int32) * query_len,
            torch.full((seqs,), context_len, dtype=torch.int32), HEAD_DIM ** -0.5)
    reference = median_ms(lambda: paged_prefill_attention(*args))
    rows = median_ms(lambda: prefill_as_decode_rows(*args))
    return {"dtype": str(dtype).removeprefix("torch."), "seqs": seqs, "query_len": query_len,
            "context_len": context_len, "reference_ms": reference, "rows_ms": rows,
            "short": query_len * context_len <= SHORT_CHUNK}


def markdown(rec: dict) -> str:
    m = rec["machine"]
    lines = ["# Prefill attention: the reference against decode rows", "",
             f"Measured {rec['date']} on {m['cpu']} ({m['cores']} cores, {bf16_words(m)}), "
             f"torch {m['torch']}; {rec['seconds']:.0f} s.",
             f"Command: `{rec['command']}`. One layer of the embedded model ({HEADS} query "
             f"heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}), blocks of {BLOCK_SIZE} "
             "tokens scattered at random; median of 10.", "",
             f"`SHORT_CHUNK` = {rec['short_chunk']}: a chunk whose query length x context "
             "length is at most that goes through the decode kernel.", "",
             "| dtype | seqs x query len | context | reference ms | decode rows ms "
             "| reference / rows | engine takes |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['seqs']} x {r['query_len']} | {r['context_len']} | "
              f"{r['reference_ms']:.2f} | {r['rows_ms']:.2f} | "
              f"{r['reference_ms'] / r['rows_ms']:.2f}x | "
              f"{'decode rows' if r['short'] else 'reference'} |" for r in rec["runs"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    begin = time.perf_counter()
    runs = [one_shape(dtype, *shape) for dtype in (torch.float32, torch.bfloat16)
            for shape in SHAPES]
    rec = {**record_head("python -m bench.profiles.prefill_attention"),
           "short_chunk": SHORT_CHUNK, "runs": runs, "seconds": time.perf_counter() - begin}
    write_results(args.out_dir, "prefill-attention", rec, markdown(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
