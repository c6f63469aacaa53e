"""Measure the answers of exercise 08's "Predict, then measure" (solutions.md).

    flock /tmp/cpu.lock .venv/bin/python 08-levers-and-the-real-vllm/exercises/measure.py

On the embedded model (SmolLM2-135M-Instruct, float32), with the reference
(common/layers/quantization.py), in about a minute on 2 cores:

1. the bytes: the whole model and its 210 quantized linear layers, float32
   against int8 (and int4, chapter 08's other scheme);
2. the error: of each weight, in units of its row's scale, and of one
   layer's output on the model's own activations (the input of layer 0's
   projections for the first prompt), per output channel against one
   scale for the whole tensor, for two layers and over all 210;
3. the tokens: three prompts, 32 greedy tokens each, through the engine in
   float32, in int8 (the reference: `int8_linear`) and in int8 written as
   its definition (dequantize, then F.linear);
4. the time of one layer at a decode step (1 row) and at a prefill (64
   rows): the float32 F.linear, `int8_linear`, dequantize + F.linear, and
   PyTorch's packed int8 kernel (bfloat16 activations), median of 200,
   the four in turn at every run.

Writes `results/measured-DATE.json` beside this file, with the machine.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.record import measurement_machine, write_measurement  # noqa: E402
from common.layers import quantization as quant  # noqa: E402

COMMAND = "python 08-levers-and-the-real-vllm/exercises/measure.py"
MiB = 2**20


def machine() -> dict:
    """The bench's record of the machine, with the date, the load average
    at the start and the threads."""
    return {**measurement_machine(), "torch_threads": torch.get_num_threads()}


def fresh(loaded):
    """A copy of the loaded model: quantization swaps its layers in place."""
    return replace(loaded, model=copy.deepcopy(loaded.model))


def linear_paths(model) -> list[str]:
    from common.models import quantizable_linears
    return quantizable_linears(model, quant.QuantScheme.INT8)


def sizes(loaded) -> dict:
    """Bytes of the whole model and of its quantizable linear layers."""
    from common.memory import weight_bytes
    paths = linear_paths(loaded.model)
    record = {"linear_layers": len(paths),
              "linear_weights": sum(loaded.model.get_submodule(p).weight.numel() for p in paths),
              "all_parameters": sum(p.numel() for p in loaded.model.parameters())}
    for scheme in (None, "int8", "int4"):
        copy_ = fresh(loaded)
        if scheme:
            quant.quantize_linears(copy_.model, paths, quant.QuantScheme(scheme),
                                   quant.ReferenceQuantOps)
        layers = [copy_.model.get_submodule(p) for p in paths]
        linear = sum(t.numel() * t.element_size() for layer in layers
                     for t in [*layer.parameters(), *layer.buffers()])
        total = weight_bytes(copy_.model)
        record[scheme or "float32"] = {"model_bytes": total, "model_mib": round(total / MiB, 1),
                                       "linear_bytes": linear,
                                       "linear_mib": round(linear / MiB, 1),
                                       "rest_mib": round((total - linear) / MiB, 1)}
    f32, i8, i4 = record["float32"], record["int8"], record["int4"]
    record["linear_ratio_float32_over_int8"] = round(f32["linear_bytes"] / i8["linear_bytes"], 2)
    record["model_ratio_float32_over_int8"] = round(f32["model_bytes"] / i8["model_bytes"], 2)
    record["model_ratio_float32_over_int4"] = round(f32["model_bytes"] / i4["model_bytes"], 2)
    record["int8_bytes_per_linear_weight"] = round(i8["linear_bytes"] / record["linear_weights"], 4)
    return record


def per_tensor_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mistake: one scale for the whole tensor, repeated per row."""
    w = weight.float()
    scale = w.abs().max().clamp(min=1e-12) / 127
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return q, scale.expand(w.shape[0]).clone()


def layer_error(weight: torch.Tensor, x: torch.Tensor, quantize) -> dict:
    q, scales = quantize(weight)
    w_hat = quant.dequantize_int8(q, scales)
    err = (w_hat - weight).abs()
    y, y_hat = F.linear(x, weight), quant.int8_linear(x, q, scales)
    dy = (y_hat - y).abs()
    return {"max_abs_weight_error": float(err.max()),
            "max_weight_error_in_steps": round(float((err / scales[:, None]).max()), 4),
            "rms_weight_error": float(err.pow(2).mean().sqrt()),
            "max_abs_weight": float(weight.abs().max()),
            "mean_abs_weight": float(weight.abs().mean()),
            "rows_using_under_half_the_range": int((q.abs().amax(dim=1) < 64).sum()),
            "max_abs_output_error": float(dy.max()),
            "max_abs_output": float(y.abs().max()),
            "output_error_relative_pct": round(float(dy.norm() / y.norm()) * 100, 3)}


def errors(loaded) -> dict:
    """Per channel (the reference) against per tensor, on the model's own
    activations: the inputs of layer 0's attention and MLP projections and
    of its down projection, for the first prompt."""
    from common.loader import apply_chat_template
    from tests.conftest import PROMPTS
    model, layer0 = loaded.model, loaded.model.model.layers[0]
    inputs = {}

    def keep(name):
        return lambda module, args: inputs.setdefault(name, args[0].detach()[0])

    hooks = [layer0.self_attn.q_proj.register_forward_pre_hook(keep("self_attn.q_proj")),
             layer0.mlp.down_proj.register_forward_pre_hook(keep("mlp.down_proj"))]
    ids = apply_chat_template(loaded.tokenizer, PROMPTS[0])
    with torch.no_grad():
        model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    record = {"prompt_tokens": len(ids), "layers": {}}
    for path, x in inputs.items():  # x: (prompt tokens, in_features)
        weight = layer0.get_submodule(path).weight.data
        channel = layer_error(weight, x, quant.quantize_int8)
        tensor = layer_error(weight, x, per_tensor_int8)
        record["layers"][f"model.layers.0.{path}"] = {
            "shape": list(weight.shape), "per_channel": channel, "per_tensor": tensor,
            "rms_weight_error_ratio_tensor_over_channel": round(
                tensor["rms_weight_error"] / channel["rms_weight_error"], 2),
            "output_error_ratio_tensor_over_channel": round(
                tensor["output_error_relative_pct"] / channel["output_error_relative_pct"], 2)}
    ratios, worst_steps = [], 0.0
    for path in linear_paths(model):  # every layer's weights: RMS error, tensor / channel
        weight = model.get_submodule(path).weight.data
        q, s = quant.quantize_int8(weight)
        channel = (quant.dequantize_int8(q, s) - weight).pow(2).mean().sqrt()
        worst_steps = max(worst_steps, float(((quant.dequantize_int8(q, s) - weight).abs()
                                              / s[:, None]).max()))
        q, s = per_tensor_int8(weight)
        tensor = (quant.dequantize_int8(q, s) - weight).pow(2).mean().sqrt()
        ratios.append(float(tensor / channel))
    record["all_layers_rms_error_per_tensor_over_per_channel"] = {
        "min": round(min(ratios), 2), "median": round(statistics.median(ratios), 2),
        "max": round(max(ratios), 2)}
    record["all_layers_max_weight_error_in_steps"] = round(worst_steps, 4)
    return record


def dequantize_then_linear(x, layer):
    w = quant.dequantize_int8(layer.qweight, layer.scales).to(x.dtype)
    return F.linear(x, w, layer.bias)


def tokens(loaded, max_tokens: int) -> dict:
    """Greedy tokens through the engine: float32, int8, int8 as its definition."""
    from common.config import EngineConfig
    from common.engine.parts import assemble_engine
    from common.loader import apply_chat_template
    from tests.conftest import PROMPTS
    from tests.engine_helpers import greedy, run_all
    prompts = {f"r{i}": apply_chat_template(loaded.tokenizer, m) for i, m in enumerate(PROMPTS)}
    definition = SimpleNamespace(name="dequantize + F.linear", linear=dequantize_then_linear,
                                 quantize=quant.ReferenceQuantOps.quantize)
    runs = {"float32": (None, None), "int8": ("int8", quant.ReferenceQuantOps),
            "int8_dequantize_then_linear": ("int8", definition)}
    out = {}
    for name, (scheme, ops) in runs.items():
        engine = assemble_engine(EngineConfig(quantization=scheme, device_memory_gb=2.0),
                           loaded=fresh(loaded), quant_ops=ops)
        started = time.perf_counter()
        done = run_all(engine, prompts, greedy(max_tokens))
        out[name] = {"wall_s": round(time.perf_counter() - started, 2),
                     "tokens": {r: done[r].token_ids for r in prompts},
                     "text": {r: done[r].text for r in prompts}}
    agreement = {}
    for other in ("int8", "int8_dequantize_then_linear"):
        per_prompt = {}
        for r in prompts:
            a, b = out["float32"]["tokens"][r], out[other]["tokens"][r]
            first = next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), None)
            per_prompt[r] = {"same": a == b, "first_difference_at": first,
                             "tokens": [len(a), len(b)]}
        agreement[f"float32_vs_{other}"] = per_prompt
    agreement["int8_vs_int8_dequantize_then_linear_same"] = (
        out["int8"]["tokens"] == out["int8_dequantize_then_linear"]["tokens"])
    return {"max_tokens": max_tokens, "runs": out, "agreement": agreement}


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


def timing(loaded, runs: int) -> dict:
    """One layer (layer 0's gate_proj, 576 -> 1536), decode and prefill rows."""
    linear = loaded.model.model.layers[0].mlp.gate_proj
    weight = linear.weight.data
    ref = quant.QuantLinear(linear, "int8", quant.ReferenceQuantOps)
    packed = quant.QuantLinear(linear, "int8", quant.CpuPackedQuantOps)
    record = {"layer": "model.layers.0.mlp.gate_proj", "shape": list(weight.shape), "runs": runs}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 64):
            x = torch.randn(rows, weight.shape[1], generator=gen)
            medians = median_us({
                "float32 F.linear": lambda: F.linear(x, weight),
                "int8_linear (reference)": lambda: ref(x),
                "dequantize + F.linear": lambda: dequantize_then_linear(x, ref),
                "torch._weight_int8pack_mm (bfloat16 x)": lambda: packed(x),
            }, runs)
            record[f"rows_{rows}_median_us"] = medians
            record[f"rows_{rows}_over_float32"] = {
                name: round(us / medians["float32 F.linear"], 2) for name, us in medians.items()}
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path,
                   default=HERE / "results" / f"measured-{datetime.date.today()}.json")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=200, help="timed calls per layer variant")
    args = p.parse_args(argv)
    from common.loader import load_model
    record = {"command": COMMAND, "machine": machine()}
    loaded = load_model("smollm2", dtype="float32", device="cpu")
    record["model"] = {"name": loaded.name, "dtype": str(loaded.dtype)}
    for name, step in (("sizes", sizes), ("errors", errors),
                       ("tokens", lambda m: tokens(m, args.max_tokens)),
                       ("timing", lambda m: timing(m, args.runs))):
        print(f"--- {name}", file=sys.stderr, flush=True)
        record[name] = step(loaded)
        print(json.dumps(record[name], indent=1)[:3000], file=sys.stderr, flush=True)
    write_measurement(args.out, record)
    print(f"wrote {args.out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
