"""Why a decode step's matrix products stop where they do (ch05): bytes, not FLOPs.

    python -m bench.profiles.gemm_bandwidth

At decode batch sizes a product does few FLOPs per weight byte (2 x rows
per weight, so 64 FLOP per byte of bfloat16 at 64 rows): it waits for its
weights more than it computes. This measures, on this machine:

1. how fast it reads memory at all: a sum over a 256 MiB tensor (GB/s);
2. each product of a SmolLM2 decoder layer, and the LM head, as a decode
   step runs them: the weights cycled through 30 copies so that none is
   in cache (the model's 30 layers), bfloat16 packed for oneDNN
   (common/layers/cpu_gemm.py) and float32 through F.linear, at 32 and 64
   rows: microseconds per product, the weight bytes read per second and
   GFLOP/s;
3. float32 through MKL's packed GEMM (what torch.compile's weight freezing
   uses on the CPU) at the batch size it was packed for and at others.

Results: bench/results/DATE-HOST-gemm-bandwidth.{json,md}.

Left out: float16, quantized weights (ch08's levers), more than one socket.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.record import bf16_words, record_head, write_results
from common.layers.cpu_gemm import PackedLinear, packs_weights

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query and 3 KV heads of 64, vocabulary 49,152
PRODUCTS = {"q/k/v": (960, 576), "o_proj": (576, 576), "gate/up": (3072, 576),
            "down_proj": (576, 1536), "LM head": (49152, 576)}
LAYERS = 30


def seconds_per_call(fn, calls: int) -> float:
    fn()  # warm-up
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - begin) / calls


def read_bandwidth_gb_s() -> float:
    x = torch.randn(64 * 2 ** 20)  # 256 MiB of float32, written: real pages
    return x.numel() * 4 / seconds_per_call(x.sum, 5) / 1e9


def product_row(name: str, shape: tuple[int, int], rows: int, dtype: torch.dtype) -> dict:
    """One product, cold: `copies` weights of this shape, one after another."""
    out_features, in_features = shape
    copies = 1 if name == "LM head" else LAYERS  # the head: 56 MB, already out of cache
    weights = [torch.randn(shape).to(dtype) for _ in range(copies)]
    gemms = [PackedLinear(w) if dtype == torch.bfloat16 else
             (lambda x, w=w: F.linear(x, w)) for w in weights]
    x = torch.randn(rows, in_features).to(dtype)

    def every_copy():
        for gemm in gemms:
            gemm(x)

    s = seconds_per_call(every_copy, 5) / copies
    weight_bytes = out_features * in_features * weights[0].element_size()
    return {"product": name, "dtype": str(dtype).removeprefix("torch."), "rows": rows,
            "shape": list(shape), "us": s * 1e6, "weight_gb_s": weight_bytes / s / 1e9,
            "gflop_s": 2 * rows * out_features * in_features / s / 1e9}


def mkl_packed_rows(packed_for: int = 64) -> list[dict]:
    """float32: MKL's packed GEMM against F.linear, the 30 layers' products."""
    weights = [torch.randn(shape) for _ in range(LAYERS) for name, shape in PRODUCTS.items()
               if name != "LM head"]
    packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, packed_for) for w in weights]
    rows = []
    for m in (16, 32, 48, 64):
        inputs = {n: torch.randn(m, n) for n in (576, 1536)}
        times: dict[str, list[float]] = {"plain": [], "mkl": []}
        for _ in range(7):  # in turn, medians: this machine drifts between seconds
            times["plain"].append(seconds_per_call(
                lambda: [F.linear(inputs[w.shape[1]], w) for w in weights], 2))
            times["mkl"].append(seconds_per_call(lambda: [torch.ops.mkl._mkl_linear(
                inputs[w.shape[1]], p, w, None, packed_for) for w, p in zip(weights, packed)], 2))
        plain, mkl = (sorted(t)[len(t) // 2] for t in (times["plain"], times["mkl"]))
        rows.append({"rows": m, "packed_for": packed_for, "f_linear_ms": plain * 1e3,
                     "mkl_packed_ms": mkl * 1e3, "speedup": plain / mkl})
    return rows


def markdown(rec: dict) -> str:
    m = rec["machine"]
    lines = ["# Decode-step products: bytes, not FLOPs", "",
             f"Measured {rec['date']} on {m['cpu']} ({m['cores']} cores, {bf16_words(m)}), "
             f"torch {m['torch']}; {torch.get_num_threads()} threads; "
             f"{rec['minutes'] * 60:.0f} s.",
             f"Command: `{rec['command']}`.", "",
             f"Reading memory (a sum over 256 MiB of float32): **{rec['read_gb_s']:.1f} GB/s**.",
             "", "Each product of a decoder layer as a decode step runs it, cold (30 copies "
             "cycled; the LM head is 56 MB in bfloat16 by itself): bfloat16 packed for oneDNN, "
             "float32 through F.linear.", "",
             "| product | weight | dtype | rows | us | weight GB/s | GFLOP/s |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['product']} | {r['shape'][0]} x {r['shape'][1]} | {r['dtype']} | "
              f"{r['rows']} | {r['us']:.0f} | {r['weight_gb_s']:.1f} | {r['gflop_s']:.0f} |"
              for r in rec["products"]]
    if rec.get("mkl"):
        lines += ["", "float32, the 30 layers' products: MKL's packed GEMM (packed for "
                  f"{rec['mkl'][0]['packed_for']} rows) against F.linear, in turn, medians of 7:", "",
                  "| rows | F.linear ms | MKL packed ms | speed-up |", "|---|---|---|---|"]
        lines += [f"| {r['rows']} | {r['f_linear_ms']:.1f} | {r['mkl_packed_ms']:.1f} | "
                  f"{r['speedup']:.2f}x |" for r in rec["mkl"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    begin = time.perf_counter()
    products = [product_row(name, shape, rows, dtype)
                for dtype in (torch.bfloat16, torch.float32)
                if dtype == torch.float32 or packs_weights(torch.zeros(1, dtype=dtype))
                for rows in (32, 64) for name, shape in PRODUCTS.items()]
    rec = {**record_head("python -m bench.profiles.gemm_bandwidth"),
           "read_gb_s": read_bandwidth_gb_s(), "products": products,
           "mkl": mkl_packed_rows() if torch.backends.mkl.is_available() else None,
           "minutes": (time.perf_counter() - begin) / 60}
    write_results(args.out_dir, "gemm-bandwidth", rec, markdown(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
