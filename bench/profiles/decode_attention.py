"""Decode attention on the CPU: the C++ kernel now against an earlier version of it.

    python -m bench.profiles.decode_attention --before 1beb437   # about 30 s

Times one layer's decode attention over random paged caches, for batches
of several shapes (sequences x context lengths: one long context, a few,
the long-prompt load's 16, a full batch), three ways, in one run:

- the reference (`attention.paged_decode_attention`: gather every
  context out of the blocks, padded, then a masked SDPA);
- the kernel of the revision `--before` names (its
  csrc/paged_attention_cpu.cpp, built here under another name): before
  issue 50, one thread per sequence;
- the kernel now: long contexts cut into pieces of 512 tokens that run on
  different threads, merged at the end (flash-decoding).

Left out: the rest of the layer, the store of K/V.
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.loadtest import ROOT
from bench.profiles.prefill_attention import (
    BLOCK_SIZE,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    median_ms,
    random_cache,
)
from bench.record import bf16_words, record_head, write_results
from common.layers import cpp_extensions
from common.layers.attention import paged_decode_attention
from common.layers.cpu_attention import build_extension

KERNEL = "common/layers/csrc/paged_attention_cpu.cpp"
# (sequences, context length of each): one long context, a few, the long
# load's 16 documents, a full batch of short chats, a full batch of documents
SHAPES = [(1, 2048), (1, 4096), (2, 1300), (4, 1300), (16, 1300), (64, 300), (64, 1300)]


def build_before(revision: str):
    """The decode kernel of an earlier revision, compiled under its own name."""
    source = subprocess.run(["git", "show", f"{revision}:{KERNEL}"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    folder = Path(tempfile.mkdtemp(prefix="decode-before-"))
    (folder / "paged_attention_cpu.cpp").write_text(source)
    from torch.utils.cpp_extension import load
    cpp_extensions.ninja_on_path()
    return load(name=f"course_paged_attention_{revision}",
                sources=[str(folder / "paged_attention_cpu.cpp")],
                extra_cflags=list(cpp_extensions.FLAGS["paged_attention_cpu"]),
                build_directory=str(folder), verbose=False)


def random_batch(dtype: torch.dtype, seqs: int, context_len: int) -> tuple:
    gen = torch.Generator().manual_seed(seqs * context_len)
    return (torch.randn(seqs, HEADS, HEAD_DIM, generator=gen).to(dtype),
            *random_cache(dtype, seqs, context_len, gen),
            torch.full((seqs,), context_len, dtype=torch.int32), HEAD_DIM ** -0.5)


def one_shape(before, dtype: torch.dtype, seqs: int, context_len: int) -> dict:
    args = random_batch(dtype, seqs, context_len)
    now = build_extension()
    return {"dtype": str(dtype).removeprefix("torch."), "seqs": seqs,
            "context_len": context_len,
            "reference_ms": median_ms(lambda: paged_decode_attention(*args)),
            "before_ms": median_ms(lambda: before.paged_decode_attention(*args)),
            "now_ms": median_ms(lambda: now.paged_decode_attention(*args))}


def markdown(rec: dict) -> str:
    m = rec["machine"]
    lines = ["# Decode attention: the C++ kernel now against its version before", "",
             f"Measured {rec['date']} on {m['cpu']} ({m['cores']} cores, {bf16_words(m)}), "
             f"torch {m['torch']}; {rec['seconds']:.0f} s.",
             f"Command: `{rec['command']}`. One layer of the embedded model ({HEADS} query "
             f"heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}), blocks of {BLOCK_SIZE} "
             f"tokens scattered at random; median of 10. Before: the kernel at "
             f"{rec['before']}.", "",
             "| dtype | seqs x context | reference ms | before ms | now ms | before / now "
             "| reference / now |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['seqs']} x {r['context_len']} | {r['reference_ms']:.2f} | "
              f"{r['before_ms']:.2f} | {r['now_ms']:.2f} | "
              f"{r['before_ms'] / r['now_ms']:.2f}x | {r['reference_ms'] / r['now_ms']:.2f}x |"
              for r in rec["runs"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="a git revision: its kernel is 'before'")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--tag", default="", help="a suffix for the results file")
    args = parser.parse_args(argv)
    before = build_before(args.before)
    begin = time.perf_counter()
    runs = [one_shape(before, dtype, *shape) for dtype in (torch.float32, torch.bfloat16)
            for shape in SHAPES]
    command = f"python -m bench.profiles.decode_attention --before {args.before}"
    rec = {**record_head(command), "before": args.before, "runs": runs,
           "seconds": time.perf_counter() - begin}
    write_results(args.out_dir, "decode-attention" + args.tag, rec, markdown(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
