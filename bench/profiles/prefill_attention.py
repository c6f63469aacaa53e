"""Prefill attention on the CPU: the PyTorch reference, decode rows, and the tiled kernel.

`python -m bench.profiles.prefill_attention` (about 30 s) times one layer's
prefill attention over random paged caches, for chunks of several shapes
(sequences x query length, context length: the load test's prompts, then
the chunks of long prompts), three ways:

- the reference (`attention.paged_prefill_attention`: per sequence, gather
  its K/V out of the blocks, build the causal mask, run SDPA);
- decode rows (`prefill_as_decode_rows` below: each new token one decode
  row of the C++ decode kernel, reading the blocks in place; how the engine
  ran short chunks before the tiled kernel, the reference running the
  long ones);
- the tiled kernel (csrc/prefill_attention_cpu.cpp, issue 50: query tiles
  against key tiles staged from the blocks, flash attention's online
  softmax), what the engine runs now, but for long bfloat16 chunks on a
  CPU with AMX (`cpu_attention.to_the_reference`): the last column says
  which of the two the engine takes.

Files from before the tiled kernel (2026-12-04) have the first two only.

Left out: the store of K/V (the same for all), the rest of the layer.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.record import bf16_words, record_head, write_results
from common.layers.attention import paged_prefill_attention
from common.layers.cpu_attention import (
    build_extension,
    build_prefill_extension,
    to_the_reference,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16  # the embedded model's layer
# (sequences, query length, context length): the load test's prompts, then longer
# chunks: a 1,250-token document's chunks of 256 and 512, a prefix hit's tail
SHAPES = [(16, 32, 32), (14, 36, 36), (8, 64, 64), (4, 128, 128), (2, 256, 256),
          (1, 512, 512), (2, 256, 1280), (1, 512, 1024), (1, 512, 1536), (16, 30, 1030),
          (1, 128, 1024), (1, 512, 2048)]


def prefill_as_decode_rows(query, k_cache, v_cache, block_tables, query_start_loc,
                           context_lens, scale):
    """Causal prefill attention through the decode kernel: the new token j
    of a sequence (position context_len - query_len + j) is one decode row
    that sees the first context_len - query_len + j + 1 tokens of the same
    block table. Exactly the causal mask; each row reads its context in
    place, so the work grows with query_len x context_len."""
    query_lens = query_start_loc.diff().long()  # (S,)
    seq_of_row = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)  # (T,)
    index = torch.arange(query.shape[0]) - query_start_loc[seq_of_row]
    seen = (context_lens - query_lens)[seq_of_row] + index + 1  # (T,) keys each row sees
    return build_extension().paged_decode_attention(
        query, k_cache, v_cache, block_tables[seq_of_row], seen.to(torch.int32), scale)


def median_ms(fn, repeats: int = 10) -> float:
    for _ in range(3):  # warm: the first calls allocate
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def random_cache(dtype: torch.dtype, seqs: int, context_len: int, gen: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V caches with each sequence's blocks scattered at random, and
    the block tables: (k_cache, v_cache, block_tables)."""
    per_seq = -(-context_len // BLOCK_SIZE)
    num_blocks = seqs * per_seq + 1
    cache_shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:seqs * per_seq].reshape(seqs, per_seq)
    return k_cache, v_cache, tables.to(torch.int32)


def one_shape(dtype: torch.dtype, seqs: int, query_len: int, context_len: int) -> dict:
    gen = torch.Generator().manual_seed(seqs * query_len + context_len)
    args = (torch.randn(seqs * query_len, HEADS, HEAD_DIM, generator=gen).to(dtype),
            *random_cache(dtype, seqs, context_len, gen),
            torch.arange(seqs + 1, dtype=torch.int32) * query_len,
            torch.full((seqs,), context_len, dtype=torch.int32), HEAD_DIM ** -0.5)
    reference = median_ms(lambda: paged_prefill_attention(*args))
    rows = median_ms(lambda: prefill_as_decode_rows(*args))
    tiled = median_ms(lambda: build_prefill_extension().paged_prefill_attention(*args))
    picked = to_the_reference(args[0], args[4], args[5])
    return {"dtype": str(dtype).removeprefix("torch."), "seqs": seqs, "query_len": query_len,
            "context_len": context_len, "reference_ms": reference, "rows_ms": rows,
            "tiled_ms": tiled, "engine": "tiled" if picked is None else "reference"}


def markdown(rec: dict) -> str:
    m = rec["machine"]
    tiled = "tiled_ms" in rec["runs"][0]  # files from before the tiled kernel: two ways
    lines = [f"# Prefill attention: the reference against decode rows"
             f"{' and the tiled kernel' if tiled else ''}", "",
             f"Measured {rec['date']} on {m['cpu']} ({m['cores']} cores, {bf16_words(m)}), "
             f"torch {m['torch']}; {rec['seconds']:.0f} s.",
             f"Command: `{rec['command']}`. One layer of the embedded model ({HEADS} query "
             f"heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}), blocks of {BLOCK_SIZE} "
             "tokens scattered at random; median of 10.", ""]
    if not tiled:
        return "\n".join(lines + short_chunk_table(rec)) + "\n"
    lines += ["Before the tiled kernel, chunks up to 64 x 64 (query length x context "
              "length) ran as decode rows, longer ones through the reference.", "",
              "| dtype | seqs x query len | context | reference ms | decode rows ms "
              "| tiled ms | reference / tiled | decode rows / tiled | engine takes |",
              "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['seqs']} x {r['query_len']} | {r['context_len']} | "
              f"{r['reference_ms']:.2f} | {r['rows_ms']:.2f} | {r['tiled_ms']:.2f} | "
              f"{r['reference_ms'] / r['tiled_ms']:.2f}x | {r['rows_ms'] / r['tiled_ms']:.2f}x | "
              f"{r['engine']} |" for r in rec["runs"]]
    return "\n".join(lines) + "\n"


def short_chunk_table(rec: dict) -> list[str]:
    """A file from before the tiled kernel: the reference against decode rows,
    and which of the two the engine took (by SHORT_CHUNK)."""
    lines = [f"`SHORT_CHUNK` = {rec['short_chunk']}: a chunk whose query length x context "
             "length is at most that goes through the decode kernel.", "",
             "| dtype | seqs x query len | context | reference ms | decode rows ms "
             "| reference / rows | engine takes |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['seqs']} x {r['query_len']} | {r['context_len']} | "
              f"{r['reference_ms']:.2f} | {r['rows_ms']:.2f} | "
              f"{r['reference_ms'] / r['rows_ms']:.2f}x | "
              f"{'decode rows' if r['short'] else 'reference'} |" for r in rec["runs"]]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    begin = time.perf_counter()
    runs = [one_shape(dtype, *shape) for dtype in (torch.float32, torch.bfloat16)
            for shape in SHAPES]
    rec = {**record_head("python -m bench.profiles.prefill_attention"),
           "runs": runs, "seconds": time.perf_counter() - begin}
    write_results(args.out_dir, "prefill-attention", rec, markdown(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
