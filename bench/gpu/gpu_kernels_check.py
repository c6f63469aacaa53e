"""Check and time the Triton kernels against the PyTorch reference on a GPU (ch04).

    python bench/gpu/gpu_kernels_check.py [--seqs 64] [--max-context 2048]
    python bench/gpu/gpu_kernels_check.py --decode-only   # the decode kernel, timed

For two attention shapes (SmolLM2-135M: 9 query heads, 3 KV heads,
head_dim 64; Llama-3-8B: 32/8, head_dim 128) in bfloat16 with block size 16,
it builds a paged cache with shuffled blocks and runs `store_kvcache`,
`paged_decode_attention` (64 sequences, contexts up to 2048) and
`paged_prefill_attention` (64 sequences, some with a cached prefix), from
common/layers/triton_kernels.py and from common/layers/attention.py. Both are held to a
float32 run of the reference on the same numbers; then both are timed with
CUDA events and the table shows the reference's time over Triton's.
A short float32 pass checks the exact (non-TF32) path too. Then the same
for the quantized matmuls of chapter 08 (`--quantization int8 | int4`,
common/layers/quant_kernels.py against the dequantize-then-matmul reference),
at one row (a decode step) and 64 rows, errors relative to the largest output.

`--decode-only` times the decode kernel alone (`time_decode`): at both
shapes, 64 sequences with contexts up to 2048 and 4 sequences of 8192
tokens, with split-K as `decode_num_splits` picks it and without
(`num_splits=1`), against the reference.

Exits 1 if any comparison fails or raises, 0 otherwise. On a machine without
CUDA it prints "no CUDA device, nothing to check" and exits 0.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

BF16_TOLERANCE = 2e-2  # max |error| against the float32 reference
FP32_TOLERANCE = 1e-4
DEVICE = "cuda"


@dataclass
class Shape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


SHAPES = [Shape("SmolLM2-135M", 9, 3, 64), Shape("Llama-3-8B", 32, 8, 128)]


@dataclass
class Row:
    op: str
    shape: str
    triton_err: float  # max |Triton - float32 reference|
    torch_err: float  # max |reference in bf16 - float32 reference|
    triton_ms: float | None
    torch_ms: float | None
    ok: bool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def time_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median time of one call, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def paged_cache(context_lens: list[int], block_size: int, shape: Shape, dtype: torch.dtype,
                gen: torch.Generator):
    """Random K/V cache, block tables of shuffled physical blocks (padded
    with 0), context_lens as int32 tensors, all on the GPU."""
    blocks_needed = [cdiv(n, block_size) for n in context_lens]
    num_blocks = sum(blocks_needed) + 8
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(context_lens), max(blocks_needed), dtype=torch.int32)
    for i, n in enumerate(blocks_needed):
        block_tables[i, :n] = torch.tensor([physical.pop() for _ in range(n)])
    cache_shape = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(DEVICE, dtype)
    return (k_cache, v_cache, block_tables.to(DEVICE),
            torch.tensor(context_lens, dtype=torch.int32, device=DEVICE))


def float32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.float() if t.is_floating_point() else t for t in tensors]


def check_decode(kernels, reference, shape: Shape, args, dtype, tol, timing) -> Row:
    num_seqs, max_context, block_size, gen = args.seqs, args.max_context, args.block_size, args.gen
    context_lens = torch.randint(1, max_context + 1, (num_seqs,), generator=gen).tolist()
    context_lens[0] = max_context
    k_cache, v_cache, block_tables, lens = paged_cache(context_lens, block_size, shape, dtype, gen)
    query = torch.randn(num_seqs, shape.num_heads, shape.head_dim, generator=gen).to(DEVICE, dtype)
    scale = shape.head_dim ** -0.5
    inputs = (query, k_cache, v_cache, block_tables, lens)

    out = kernels.paged_decode_attention(*inputs, scale)  # (num_seqs, H, D)
    out_torch = reference.paged_decode_attention(*inputs, scale)
    truth = reference.paged_decode_attention(*float32(*inputs), scale)
    return finish("decode", shape, out, out_torch, truth, tol, timing,
                  lambda: kernels.paged_decode_attention(*inputs, scale),
                  lambda: reference.paged_decode_attention(*inputs, scale))


def check_prefill(kernels, reference, shape: Shape, args, dtype, tol, timing) -> Row:
    num_seqs, max_context, block_size, gen = args.seqs, args.max_context, args.block_size, args.gen
    query_lens, context_lens = [], []
    longest_query = min(args.max_query, max_context)
    for i in range(num_seqs):
        query_len = int(torch.randint(1, longest_query + 1, (1,), generator=gen))
        # Every other sequence has a cached prefix (prefix caching, a chunk).
        room = max_context - query_len
        prefix = int(torch.randint(0, room + 1, (1,), generator=gen)) if i % 2 else 0
        query_lens.append(query_len)
        context_lens.append(prefix + query_len)
    k_cache, v_cache, block_tables, lens = paged_cache(context_lens, block_size, shape, dtype, gen)
    query_start_loc = torch.tensor([0] + query_lens).cumsum(0).to(DEVICE, torch.int32)
    query = torch.randn(sum(query_lens), shape.num_heads, shape.head_dim,
                        generator=gen).to(DEVICE, dtype)
    scale = shape.head_dim ** -0.5
    inputs = (query, k_cache, v_cache, block_tables, query_start_loc, lens)

    out = kernels.paged_prefill_attention(*inputs, scale)  # (num_tokens, H, D)
    out_torch = reference.paged_prefill_attention(*inputs, scale)
    truth = reference.paged_prefill_attention(*float32(*inputs), scale)
    return finish("prefill", shape, out, out_torch, truth, tol, timing,
                  lambda: kernels.paged_prefill_attention(*inputs, scale),
                  lambda: reference.paged_prefill_attention(*inputs, scale))


def check_store(kernels, reference, shape: Shape, args, dtype, tol, timing) -> Row:
    num_tokens, block_size, gen = args.store_tokens, args.block_size, args.gen
    num_blocks = cdiv(num_tokens, block_size) * 2
    cache_shape = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    kv_shape = (num_tokens, shape.num_kv_heads, shape.head_dim)
    key = torch.randn(kv_shape, generator=gen).to(DEVICE, dtype)
    value = torch.randn(kv_shape, generator=gen).to(DEVICE, dtype)
    caches = [torch.zeros(cache_shape, dtype=dtype, device=DEVICE) for _ in range(4)]
    kernels.store_kvcache(key, value, caches[0], caches[1], slot_mapping)
    reference.store_kvcache(key, value, caches[2], caches[3], slot_mapping)
    exact = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    row = finish("store", shape, caches[0], caches[2], caches[2], 0.0, timing,
                 lambda: kernels.store_kvcache(key, value, caches[0], caches[1], slot_mapping),
                 lambda: reference.store_kvcache(key, value, caches[2], caches[3], slot_mapping))
    row.ok = row.ok and exact
    return row


def finish(op: str, shape: Shape, out, out_torch, truth, tol, timing, run_triton, run_torch) -> Row:
    triton_err = (out.float() - truth.float()).abs().max().item()
    torch_err = (out_torch.float() - truth.float()).abs().max().item()
    ok = triton_err <= tol and bool(torch.isfinite(out).all())
    triton_ms = torch_ms = None
    if timing is not None:
        triton_ms = time_ms(run_triton, *timing)
        torch_ms = time_ms(run_torch, *timing)
    return Row(op, shape.name, triton_err, torch_err, triton_ms, torch_ms, ok)


QUANT_SHAPES = [(1, 2048, 8192), (64, 2048, 8192)]  # (rows of x, in, out): decode, batch


def check_quantized(scheme: str, shape: tuple[int, int, int], args, dtype, tol, timing) -> Row:
    """ch08: the int8 / int4 Triton matmuls against the reference (dequantize
    + F.linear), errors relative to the largest output of a float32 run."""
    from common.layers import quant_kernels, quantization
    rows, in_features, out_features = shape
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    torch.nn.init.normal_(linear.weight, std=0.02, generator=args.gen)
    layer = quantization.QuantLinear(linear.to(DEVICE), scheme, quant_kernels.TritonQuantOps)
    x = torch.randn(rows, in_features, generator=args.gen).to(DEVICE, dtype)
    ref = quantization.ReferenceQuantOps
    out, out_torch = layer(x), ref.linear(x, layer)
    truth = ref.linear(x.float(), layer)
    norm = truth.abs().max().item()
    row = finish(f"{scheme} mm", Shape(f"M={rows} {in_features}x{out_features}", 0, 0, 0),
                 out / norm, out_torch / norm, truth / norm, tol, timing,
                 lambda: layer(x), lambda: ref.linear(x, layer))
    return row


def print_table(title: str, rows: list[Row]) -> None:
    print(f"\n{title}")
    header = (f"{'op':8} {'shape':14} {'triton ms':>10} {'torch ms':>10} {'speedup':>8} "
              f"{'triton err':>11} {'torch err':>10}  result")
    print(header)
    print("-" * len(header))
    for r in rows:
        timed = r.triton_ms is not None and r.torch_ms is not None
        t_ms = f"{r.triton_ms:10.3f}" if timed else f"{'-':>10}"
        p_ms = f"{r.torch_ms:10.3f}" if timed else f"{'-':>10}"
        speedup = f"{r.torch_ms / r.triton_ms:7.1f}x" if timed and r.triton_ms > 0 else f"{'-':>8}"
        print(f"{r.op:8} {r.shape:14} {t_ms} {p_ms} {speedup} {r.triton_err:11.2e} "
              f"{r.torch_err:10.2e}  {'ok' if r.ok else 'FAIL'}")


def run_all(kernels, reference, args, dtype: torch.dtype, tol: float, timing) -> list[Row]:
    rows = []
    for shape in SHAPES:
        for check in (check_store, check_decode, check_prefill):
            name = f"{check.__name__[6:]} {shape.name} {str(dtype)[6:]}"
            try:
                rows.append(check(kernels, reference, shape, args, dtype, tol, timing))
            except Exception:  # report it and go on with the other checks
                print(f"\n{name}: raised")
                traceback.print_exc()
                rows.append(Row(check.__name__[6:], shape.name, float("nan"), float("nan"),
                                None, None, False))
            torch.cuda.empty_cache()
    for scheme in ("int8", "int4"):
        for shape in QUANT_SHAPES:
            try:
                rows.append(check_quantized(scheme, shape, args, dtype, tol, timing))
            except Exception:  # report it and go on
                print(f"\n{scheme} mm {shape} {str(dtype)[6:]}: raised")
                traceback.print_exc()
                rows.append(Row(f"{scheme} mm", str(shape), float("nan"), float("nan"),
                                None, None, False))
    return rows


@dataclass
class DecodeRow:
    shape: str
    load: str
    num_splits: int  # what decode_num_splits picked
    triton_ms: float  # with those splits
    one_split_ms: float  # num_splits=1: one program per (sequence, KV head)
    torch_ms: float
    err: float  # max |Triton - float32 reference|
    ok: bool


DECODE_LOADS = [("64 seqs <= 2048", 64, 2048, False), ("4 seqs x 8192", 4, 8192, True)]


def time_decode(kernels, reference, args) -> list[DecodeRow]:
    """The decode kernel in bfloat16 against the reference, with and without
    split-K, at both shapes and both loads (DECODE_LOADS: name, sequences,
    longest context, all that long)."""
    rows = []
    for shape in SHAPES:
        for load, num_seqs, max_context, all_long in DECODE_LOADS:
            lens = ([max_context] * num_seqs if all_long else
                    torch.randint(1, max_context + 1, (num_seqs,), generator=args.gen).tolist())
            k_cache, v_cache, block_tables, context_lens = paged_cache(
                lens, args.block_size, shape, torch.bfloat16, args.gen)
            query = torch.randn(num_seqs, shape.num_heads, shape.head_dim,
                                generator=args.gen).to(DEVICE, torch.bfloat16)
            inputs = (query, k_cache, v_cache, block_tables, context_lens)
            scale = shape.head_dim ** -0.5
            splits = kernels.decode_num_splits(
                num_seqs, shape.num_kv_heads, block_tables.shape[1] * args.block_size,
                kernels.multiprocessors(query.device))
            truth = reference.paged_decode_attention(*float32(*inputs), scale)
            outs = [kernels.paged_decode_attention(*inputs, scale),
                    kernels.paged_decode_attention(*inputs, scale, num_splits=1)]
            err = max((out.float() - truth).abs().max().item() for out in outs)
            timing = (args.warmup, args.iters)
            rows.append(DecodeRow(
                shape.name, load, splits,
                time_ms(lambda: kernels.paged_decode_attention(*inputs, scale), *timing),
                time_ms(lambda: kernels.paged_decode_attention(*inputs, scale, num_splits=1),
                        *timing),
                time_ms(lambda: reference.paged_decode_attention(*inputs, scale), *timing),
                err, err <= BF16_TOLERANCE))
            torch.cuda.empty_cache()
    return rows


def print_decode_table(rows: list[DecodeRow]) -> None:
    print("\nthe decode kernel, bfloat16: one program per (sequence, KV head), split-K as "
          "picked and without; speedup = torch ms / triton ms")
    header = (f"{'shape':14} {'load':16} {'splits':>6} {'triton ms':>10} {'1 split ms':>10} "
              f"{'torch ms':>9} {'speedup':>8} {'split gain':>10} {'err':>9}  result")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r.shape:14} {r.load:16} {r.num_splits:6d} {r.triton_ms:10.3f} "
              f"{r.one_split_ms:10.3f} {r.torch_ms:9.3f} {r.torch_ms / r.triton_ms:7.1f}x "
              f"{r.one_split_ms / r.triton_ms:9.2f}x {r.err:9.2e}  {'ok' if r.ok else 'FAIL'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--max-query", type=int, default=256,
                        help="longest new-token count of a prefill sequence")
    parser.add_argument("--store-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-only", action="store_true",
                        help="time the decode kernel alone, with and without split-K")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        print("no CUDA device, nothing to check")
        return 0

    import triton

    from common.layers import attention as reference
    from common.layers import triton_kernels as kernels

    args.gen = torch.Generator().manual_seed(args.seed)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"{args.seqs} sequences, contexts up to {args.max_context}, block size "
          f"{args.block_size}; errors are max |x - float32 reference|")

    if args.decode_only:
        decode_rows = time_decode(kernels, reference, args)
        print_decode_table(decode_rows)
        return 0 if all(r.ok for r in decode_rows) else 1

    rows = run_all(kernels, reference, args, torch.bfloat16, BF16_TOLERANCE,
                   (args.warmup, args.iters))
    print_table(f"bfloat16 (tolerance {BF16_TOLERANCE:g}); speedup = torch ms / triton ms", rows)

    small = argparse.Namespace(**{**vars(args), "seqs": 8, "max_context": 300,
                                  "max_query": 100, "store_tokens": 512})
    rows32 = run_all(kernels, reference, small, torch.float32, FP32_TOLERANCE, timing=None)
    print_table(f"float32, small, not timed (tolerance {FP32_TOLERANCE:g})", rows32)

    failed = [r for r in rows + rows32 if not r.ok]
    print(f"\n{len(failed)} of {len(rows) + len(rows32)} checks failed" if failed
          else f"\nall {len(rows) + len(rows32)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
