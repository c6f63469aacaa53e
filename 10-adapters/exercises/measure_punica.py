"""Measure the answers of exercise 10a's "Predict, then measure" (solutions.md).

    flock /tmp/cpu.lock .venv/bin/python 10-adapters/exercises/measure_punica.py

On the embedded model (SmolLM2-135M-Instruct, float32), with the course's
products (common/lora/punica.py and punica_wrapper.py), in about a minute
on 2 cores once the machine is quiet (it waits up to 5 minutes for a
1-minute load average below 1.5 first: timings on 2 busy cores mean little):

1. the slots' bytes: one slot of every projection of the 30 layers (A,
   B and the scale), at ranks 8, 16 and 64, against the model's weights;
2. the products' time, one projection (layer 0's gate_proj, 576 -> 1536,
   rank 16, the default `--max-lora-rank`, 4 slots, B in LoRASlots'
   layout): the base product and the three forms of the products,
   gathered (`add_lora_gathered`, the exercise's), grouped
   (`add_lora_grouped`, a slot at a time; both in common/lora/punica.py)
   and stacked (common/lora/punica_wrapper.py's `add_lora_stacked`, every
   slot at once: what the engine runs on the CPU), for 16 rows (a
   decode step of 16 sequences) and 256 rows (a prefill), on 1 and on 4
   adapters, median of 200 calls, the four in turn at every call; and the
   bytes of A and B that the gathered form copies;
3. the engine, 4 slots: 16 requests of 32 tokens (greedy, no EOS) with
   the base model alone (no LoRA layers), with LoRA on but every request
   on the base model, on 1 adapter and over 4 adapters with the stacked
   and the grouped products, and over 4 with the gathered one: output
   tokens per second from the second step on (the first loads the
   adapters into their slots), the kernel each engine ran (its model
   runner's `adapters.punica.kernel`), and whether the three products
   write the same tokens. The adapters are the two trained ones of
   10-adapters/adapters/ (rank 8), each also under a second id, so that 4
   slots hold them.

Writes `results/measured-DATE-10a.json` beside this file, with the machine.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.record import measurement_machine, wait_for_quiet_machine, write_measurement  # noqa: E402
from common.lora.layers import LoRASlots  # noqa: E402
from common.lora.punica import LoRAMapping, add_lora_gathered, add_lora_grouped  # noqa: E402
from common.lora.punica_wrapper import LoRAKernel, add_lora_stacked, slot_onehot  # noqa: E402

COMMAND = "python 10-adapters/exercises/measure_punica.py"
MiB = 2**20
ADAPTERS = ROOT / "10-adapters" / "adapters"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projections(model) -> dict[str, torch.nn.Linear]:
    """Layer 0's seven projections (every layer has the same shapes)."""
    layer = model.model.layers[0]
    return {name: getattr(layer.self_attn if name in PROJECTIONS[:4] else layer.mlp, name)
            for name in PROJECTIONS}


def slot_bytes(model) -> dict:
    """One slot of every projection of every layer, at three ranks."""
    layers = len(model.model.layers)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for rank in (8, 16, 64):
        per_layer = 0  # A (r, in), B (out, r) and the scale of each projection
        for linear in projections(model).values():
            slot = LoRASlots(1, rank, linear.in_features, linear.out_features,
                             torch.float32, torch.device("cpu"))
            per_layer += sum(t.numel() for t in (slot.lora_a, slot.lora_b, slot.scaling))
        numbers = per_layer * layers
        rows.append({"rank": rank, "numbers_per_slot": numbers,
                     "float32_mib": round(numbers * 4 / MiB, 2),
                     "bfloat16_mib": round(numbers * 2 / MiB, 2),
                     "float32_pct_of_weights": round(100 * numbers * 4 / weights, 2)})
    return {"layers": layers, "model_weights_float32_mib": round(weights / MiB, 1),
            "rows": rows}


def median_us(candidates: dict, runs: int) -> dict:
    """Each candidate's median time in microseconds, the candidates in turn
    at every run: a busy machine slows them alike."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for fn in candidates.values():
        fn()  # warm-up
    for _ in range(runs):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: round(statistics.median(t) * 1e6, 1) for name, t in times.items()}


def product_timing(model, runs: int, rank: int = 16) -> dict:
    weight = projections(model)["gate_proj"].weight.data  # (1536, 576)
    d_out, d_in = weight.shape
    gen = torch.Generator().manual_seed(0)
    lora_a = torch.randn(4, rank, d_in, generator=gen) / d_in ** 0.5  # (slots, r, in)
    # B as LoRASlots keeps it: (slots, r, out), read through its (slots, out, r) view
    lora_b = (torch.randn(4, rank, d_out, generator=gen) / rank ** 0.5).transpose(1, 2)
    scaling = torch.full((4,), 2.0)
    record = {"layer": "model.layers.0.mlp.gate_proj", "shape": [d_out, d_in], "rank": rank,
              "slots": lora_a.shape[0], "runs": runs, "cases": []}
    with torch.inference_mode():
        for rows in (16, 256):
            for adapters in (1, 4):
                x = torch.randn(rows, d_in, generator=gen)
                indices = torch.arange(rows) % adapters  # every row on an adapter
                mapping = LoRAMapping.from_indices(indices)  # once a step, for every layer
                onehot = slot_onehot(indices, lora_a.shape[0], x.dtype)  # the same
                y = torch.empty(rows, d_out)
                medians = median_us({
                    "base F.linear": lambda: F.linear(x, weight),
                    "gathered": lambda: add_lora_gathered(y, x, lora_a, lora_b, scaling,
                                                          indices),
                    "grouped": lambda: add_lora_grouped(y, x, lora_a, lora_b, scaling,
                                                        mapping),
                    "stacked": lambda: add_lora_stacked(y, x, lora_a, lora_b, scaling,
                                                        onehot),
                }, runs)
                record["cases"].append({
                    "rows": rows, "adapters": adapters, "median_us": medians,
                    "over_base": {name: round(us / medians["base F.linear"], 2)
                                  for name, us in medians.items()},
                    "gathered_copy_mib": round(rows * rank * (d_in + d_out) * 4 / MiB, 2),
                    "base_weight_mib": round(weight.numel() * 4 / MiB, 2)})
    return record


def engine_runs(loaded, num_requests: int = 16, max_tokens: int = 32) -> dict:
    from common.config import EngineConfig
    from common.engine.parts import EngineParts, assemble_engine
    from common.loader import apply_chat_template
    from common.lora.model_manager import with_adapters
    from common.lora.request import LoRARequest
    from common.sampling_params import SamplingParams
    from tests.conftest import PROMPTS
    prompts = [apply_chat_template(loaded.tokenizer, PROMPTS[i % len(PROMPTS)])
               for i in range(num_requests)]
    four = [LoRARequest(f"{name}-{k}", 2 * k + j + 1, str(ADAPTERS / name))
            for k in range(2) for j, name in enumerate(("pirate", "shout"))]
    stacked, grouped, gathered = LoRAKernel.STACKED, LoRAKernel.GROUPED, LoRAKernel.GATHERED
    runs = {"base model, no LoRA layers": (None, [None]),
            "LoRA on, every request on the base model": (stacked, [None]),
            "1 adapter, stacked": (stacked, four[:1]),
            "1 adapter, grouped": (grouped, four[:1]),
            "4 adapters, stacked": (stacked, four),
            "4 adapters, grouped": (grouped, four),
            "4 adapters, gathered": (gathered, four)}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out, tokens = {}, {}
    for name, (kernel, adapters) in runs.items():
        config = EngineConfig(enable_lora=kernel is not None, max_loras=4, max_lora_rank=8,
                              device_memory_gb=2.0)
        parts = EngineParts()
        if kernel is not None:  # chapter 10's parts, the products in `kernel`'s form
            parts = with_adapters(parts, config)
            parts = replace(parts, adapters_cls=partial(parts.adapters_cls, kernel=kernel))
        engine = assemble_engine(config, parts, loaded=loaded)
        punica = getattr(engine.model_runner.adapters, "punica", None)  # None: no LoRA layers
        ran = punica.kernel.value if punica is not None else None
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{i}", ids, params, lora_request=adapters[i % len(adapters)])
        # the first step (most of the prefill, each adapter's first load) out of the timing
        before = {out.request_id: len(out.outputs[0].token_ids) for out in engine.step()}
        started, steps = time.perf_counter(), 0
        done = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = output.outputs[0].token_ids
            steps += 1
        wall = time.perf_counter() - started
        generated = sum(len(ids) for ids in done.values()) - sum(before.values())
        tokens[name] = done
        del engine
        gc.collect()
        out[name] = {"kernel": ran, "timed_steps": steps, "tokens_out": generated,
                     "wall_s": round(wall, 2), "output_tokens_per_s": round(generated / wall, 1),
                     "ms_per_step": round(1000 * wall / steps, 1)}
    base = out["base model, no LoRA layers"]["output_tokens_per_s"]
    for row in out.values():
        row["over_base_model"] = round(row["output_tokens_per_s"] / base, 2)
    return {"requests": num_requests, "max_tokens": max_tokens, "max_loras": 4, "runs": out,
            "same_tokens_as_stacked": {
                form: tokens[f"4 adapters, {form}"] == tokens["4 adapters, stacked"]
                for form in ("grouped", "gathered")}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "results" /
                   f"measured-{datetime.date.today()}-10a.json")
    p.add_argument("--runs", type=int, default=200, help="timed calls per product")
    p.add_argument("--wait-quiet", type=float, default=300.0,
                   help="seconds to wait for a quiet machine first (0: do not wait)")
    args = p.parse_args(argv)
    from common.loader import load_model
    loaded = load_model("smollm2", dtype="float32", device="cpu")
    wait_for_quiet_machine(args.wait_quiet)
    record = {"command": COMMAND, "machine": measurement_machine(),
              "model": {"name": loaded.name, "dtype": str(loaded.dtype)}}
    for name, step in (("slot_bytes", slot_bytes),
                       ("products", lambda m: product_timing(m, args.runs))):
        print(f"--- {name}", file=sys.stderr, flush=True)
        record[name] = step(loaded.model)
    print("--- engine", file=sys.stderr, flush=True)
    record["engine"] = engine_runs(loaded)
    write_measurement(args.out, record)
    print(args.out.read_text())
    print(f"wrote {args.out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
