"""Where a decode step's time goes (ch05-06): a wall-clock breakdown and a torch.profiler table.

    python -m bench.profiles.profile_step                          # bfloat16 and float32, 32 and 64 seqs
    python -m bench.profiles.profile_step --dtypes float32 --seqs 64

For each dtype and batch size, an in-process `LLMEngine` (chapter 06's
defaults: continuous batching, prefix caching, the CPU's default 2 GiB
card unless `--card`) gets `--seqs` requests of the load test's prompts at once,
`--max-tokens` greedy tokens each, EOS ignored: the loads of `make bench`
(32 x 64 and 64 x 128 tokens). Once every sequence is decoding, it times
`--steps` decode steps two ways:

1. wall clock, by wrapping the engine's functions (scheduling, input
   preparation, each linear by name, the attention's store / gather /
   softmax, the norms, the LM head, the sampler, the output processor)
   with `time.perf_counter`: on the CPU every op is synchronous, so the
   parts add up to the step; what no wrapper covers is "other" (reshapes,
   Python, the engine's bookkeeping);
2. torch.profiler over the same kind of steps, its ops by self CPU time
   (the profiler's own overhead inflates the small ops: the wall clock is
   the reference, the table says which kernels run).

It also runs the whole load offline, as the engine alone (no HTTP), for
output tokens/s to compare with the served figures of `make bench`; and
puts each change of issue 22 (ch05: fused products, the greedy pick, the
weights packed for oneDNN, the norms and the rotary embedding in
C++; ch04: decode attention in C++)
against its previous version, in
turn on the same running batch (a before/after pair measured in one run,
immune to the machine's drift).

Against the machine: the step's arithmetic over one large product's
GFLOP/s (the roofline), its bytes over the read speed, and the limit
(issue 50): the step's matrix products alone at the roofline's speed,
over the step's time.

Results: bench/results/DATE-HOST-profile.{json,md} (`--tag` adds a suffix,
for a before/after pair).

Left out: CUDA (use torch.profiler with CUDA activities there), prefill
steps (the loads are decode-bound after their first step).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import sys
import time
from typing import Callable
from unittest.mock import patch

import torch
from torch.profiler import ProfilerActivity, profile

from bench.loadtest import prompt_messages
from bench.profiles.gemm_bandwidth import read_bandwidth_gb_s
from bench.record import (
    add_quiet_run_args,
    bf16_words,
    machine,
    render_again,
    wait_for_quiet_machine,
    write_results,
)
from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.parts import assemble_engine
from common.layers import attention as attention_module
from common.layers import cpu_gemm
from common.layers.attention import TorchOps
from common.layers.cpu_attention import CpuOps
from common.layers.cpu_gemm import dense_gemm, gemm_for
from common.layers.elementwise import CpuElementwise, TorchElementwise
from common.layers.logits import lm_head_gemm
from common.layers.sampler import SampledToken
from common.loader import apply_chat_template, load_model
from common.memory import kv_bytes_per_token, weight_bytes
from common.models import llama as llama_module
from common.sampling_params import SamplingParams

# The CPU's default card, not the demo card: the engine here shares its model
# (the A/B's earlier versions multiply by the plain weights), so the plain
# weights stay beside their packed copies and 1.1 GiB leaves no KV block.
CARD_GB = 2.0
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Timers:
    """Seconds per named part, summed over the timed steps."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.on = False

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed


def instrument(engine: LLMEngine, timers: Timers) -> contextlib.ExitStack:
    """Wrap the parts of a step with timers (undone when the stack closes)."""
    runner = engine.worker.model_runner
    model = runner.model
    names = {id(getattr(getattr(layer, part), proj)): proj
             for layer in model.layers for part in ("self_attn", "mlp")
             for proj in LINEARS if hasattr(getattr(layer, part), proj)}
    linear = llama_module.linear

    def named_linear(x, layer):
        return timers.wrap(f"linear {names.get(id(layer), '?')}", linear)(x, layer)

    ops = model.attention_ops
    stack = contextlib.ExitStack()
    for target, attr, name in [
        (engine.scheduler, "schedule", "schedule"),
        (runner, "prepare_inputs", "prepare inputs"),
        (engine.scheduler, "update_from_output", "update from output"),
        (engine.output_processor, "process", "output processor (detokenize, stops)"),
        (runner.sampling, "sampler", "sampler"),
        (model, "compute_logits", "LM head"),
        (model, "embed", "embedding"),
        (model, "attention", "attention block (all)"),
        (model, "mlp", "MLP block (all)"),
    ]:
        stack.enter_context(patch.object(target, attr, timers.wrap(name, getattr(target, attr))))
    stack.enter_context(patch.object(llama_module, "linear", named_linear))
    # ch05: q/k/v (3 parts) and gate/up (2) in one product each; o_proj, down_proj
    for attr, name in [("qkv", "linear q/k/v fused"), ("gate_up", "linear gate/up fused"),
                       ("o_proj", "linear o_proj"), ("down_proj", "linear down_proj")]:
        gemms = [g and timers.wrap(name, g) for g in getattr(model, attr)]
        stack.enter_context(patch.object(model, attr, gemms))
    norms = model.elementwise  # the norms (with the residual add) and the rotary embedding
    timed = type("TimedElementwise", (norms,), {
        "rms_norm": staticmethod(timers.wrap("RMSNorm (+ residual add)", norms.rms_norm)),
        "add_rms_norm": staticmethod(timers.wrap("RMSNorm (+ residual add)", norms.add_rms_norm)),
        "rotary": staticmethod(timers.wrap("rotary", norms.rotary))})
    stack.enter_context(patch.object(model, "elementwise", timed))
    stack.enter_context(patch.object(llama_module, "paged_attention",
                                timers.wrap("attention (all)", llama_module.paged_attention)))
    for attr, name in [("store_kvcache", "attention: store K/V"),
                       ("paged_decode_attention", "attention: decode (all)"),
                       ("paged_prefill_attention", "attention: prefill")]:
        stack.enter_context(patch.object(ops, attr, staticmethod(timers.wrap(name, getattr(ops, attr)))))
    for attr, name in [("gather_kv", "attention: decode gather K/V"),
                       ("gather_slots", "attention: decode slots"),
                       ("gather_blocks", "attention: decode gather K/V blocks")]:
        if hasattr(attention_module, attr):  # gather_blocks: since the ch04 change
            stack.enter_context(patch.object(attention_module, attr,
                                        timers.wrap(name, getattr(attention_module, attr))))
    return stack


def breakdown(seconds: dict[str, float], step_s: float) -> list[tuple[str, float]]:
    """Exclusive parts (ms per step), the wrappers' totals split into what they hold."""
    s = dict(seconds)
    linear = {p: s.pop(f"linear {p}", 0.0) for p in LINEARS}
    linear["q_proj"] += s.pop("linear q/k/v fused", 0.0)  # ch05: the three in one product
    linear["gate_proj"] += s.pop("linear gate/up fused", 0.0)
    attn_all = s.pop("attention block (all)", 0.0)
    mlp_all = s.pop("MLP block (all)", 0.0)
    paged = s.pop("attention (all)", 0.0)
    decode = s.pop("attention: decode (all)", 0.0)
    gather = sum(s.pop(k, 0.0) for k in ("attention: decode gather K/V", "attention: decode slots",
                                         "attention: decode gather K/V blocks"))
    parts = {
        "linear q/k/v": linear["q_proj"] + linear["k_proj"] + linear["v_proj"],
        "rotary": (rotary := s.pop("rotary", 0.0)),
        "reshapes (attention block, rest)": attn_all - paged - rotary
            - sum(linear[p] for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
        "attention: store K/V": s.pop("attention: store K/V", 0.0),
        "attention: decode gather K/V": gather,
        "attention: decode softmax(QK)V": decode - gather,
        "attention: prefill": s.pop("attention: prefill", 0.0),
        "linear o_proj": linear["o_proj"],
        "linear gate/up": linear["gate_proj"] + linear["up_proj"],
        "SiLU x up (MLP block, rest)":
            mlp_all - linear["gate_proj"] - linear["up_proj"] - linear["down_proj"],
        "linear down_proj": linear["down_proj"],
    }
    parts["attention: other"] = (paged - parts["attention: store K/V"] - decode
                                 - parts["attention: prefill"])
    parts.update(s)  # schedule, prepare inputs, RMSNorm, LM head, sampler, ...
    parts["other (Python, engine bookkeeping)"] = step_s - sum(parts.values())
    return sorted(((k, v) for k, v in parts.items()), key=lambda kv: -kv[1])


def previous_versions(engine: LLMEngine) -> dict[str, Callable[[], contextlib.ExitStack]]:
    """Each ch05 change of issue 22, undone: what the A/B puts the code against."""
    runner = engine.worker.model_runner
    model = runner.model

    def unfused() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(patch.object(model, "qkv", [None] * len(model.qkv)))
        stack.enter_context(patch.object(model, "gate_up", [None] * len(model.gate_up)))
        return stack

    def float32_argmax() -> contextlib.ExitStack:  # the load is plain greedy throughout
        def argmax_sampler(logits, states):
            assert all(state.plain_greedy for state in states)
            return [SampledToken(t) for t in logits.float().argmax(dim=-1).tolist()]
        return patch.object(runner.sampling, "sampler", argmax_sampler)

    def unpacked() -> contextlib.ExitStack:  # what cpu_gemm builds where nothing packs
        with patch.object(cpu_gemm, "packs_weights", lambda weight: False):
            fused_gemms = [(f, dense_gemm(f.weight, f.bias))
                           for f in model.qkv + model.gate_up if f is not None]
            products = {"o_proj": [gemm_for(layer.self_attn.o_proj) for layer in model.layers],
                        "down_proj": [gemm_for(layer.mlp.down_proj) for layer in model.layers],
                        "lm_head": lm_head_gemm(model.hf.lm_head.weight)}
        stack = contextlib.ExitStack()
        for fused, gemm in fused_gemms:
            stack.enter_context(patch.object(fused, "gemm", gemm))
        for attr, gemms in products.items():
            stack.enter_context(patch.object(model, attr, gemms))
        return stack

    changes = {"fused q/k/v and gate/up products": unfused,
               "greedy pick: max(...).indices in the logits' dtype, not argmax in float32":
                   float32_argmax}
    if model.packed_bytes:  # on a CPU with oneDNN (bfloat16: where it computes it)
        changes["weights packed for oneDNN"] = unpacked
    if model.attention_ops is CpuOps:  # ch04: the reference's gather and masked SDPA
        changes["decode attention in C++, in place (ch04)"] = lambda: patch.object(
            model, "attention_ops", TorchOps)
    if model.elementwise is CpuElementwise:  # PyTorch's ops, one pass each
        changes["RMSNorm + residual add, rotary in C++"] = lambda: patch.object(
            model, "elementwise", TorchElementwise)
    return changes


def now_vs_before(engine: LLMEngine, rounds: int, steps: int) -> list[dict]:
    """Each change against its previous version, in turn on the same running
    batch: ms per decode step, medians over the rounds."""
    rows = []
    for change, previous in previous_versions(engine).items():
        times: dict[str, list[float]] = {"before": [], "now": []}
        for _ in range(rounds):
            for variant in ("before", "now"):
                with previous() if variant == "before" else contextlib.ExitStack():
                    begin = time.perf_counter()
                    for _ in range(steps):
                        engine.step()
                    times[variant].append((time.perf_counter() - begin) / steps * 1e3)
        medians = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        rows.append({"change": change, "before_ms": medians["before"], "now_ms": medians["now"],
                     "speedup": medians["before"] / medians["now"]})
    return rows


def now_vs_before_on_a_full_batch(engine: LLMEngine, prompts: list[list[int]], rounds: int,
                                  steps: int) -> list[dict]:
    """`now_vs_before` on a fresh load long enough that every sequence is
    still decoding at its last step; then the load runs out."""
    ab_steps = len(previous_versions(engine)) * rounds * 2 * steps
    start_load(engine, prompts, max_tokens=ab_steps + 8)
    while engine.scheduler.waiting or any(s.num_output_tokens == 0
                                          for s in engine.scheduler.running):
        engine.step()  # the prefills
    rows = now_vs_before(engine, rounds, steps)
    assert len(engine.scheduler.running) == len(prompts), "a sequence finished during the A/B"
    while engine.has_unfinished_requests():
        engine.step()
    return rows


def gemm_roofline(dtype: torch.dtype, size: int = 2048, repeats: int = 10) -> float:
    """GFLOP/s of one large square matrix product on this machine (the BLAS at
    its best: what a decode step's products could reach at most)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up
    begin = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size ** 3 * repeats / (time.perf_counter() - begin) / 1e9


def product_flops_per_token(hf_model) -> float:
    """2 per weight of every matrix product: the decoder's linears and the
    LM head (not the embedding, a lookup)."""
    linear = sum(m.weight.numel() for layer in hf_model.model.layers for m in layer.modules()
                 if isinstance(m, torch.nn.Linear))
    return 2 * (linear + hf_model.lm_head.weight.numel())


def flops_per_token(hf_model, context: int) -> float:
    """The products' FLOPs plus attention's 4 x context x heads x head_dim per layer."""
    cfg, layers = hf_model.config, hf_model.model.layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention = 4 * context * cfg.num_attention_heads * head_dim * len(layers)
    return product_flops_per_token(hf_model) + attention


def step_bytes(hf_model, contexts: list[int]) -> int:
    """What a decode step must read at least: every weight once (a tied
    head counted once), and the K and V of every token each sequence attends."""
    return (weight_bytes(hf_model)
            + sum(contexts) * kv_bytes_per_token(hf_model.config, hf_model.dtype))


def start_load(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)


def measure(loaded, dtype: str, seqs: int, max_tokens: int, steps: int, card_gb: float,
            warm_steps: int, rounds: int) -> dict:
    config = EngineConfig(device="cpu", dtype=dtype, device_memory_gb=card_gb,
                          max_num_seqs=seqs, enable_prefix_caching=True)
    engine = assemble_engine(config, loaded=loaded, log_interval_s=1e9)
    prompts = [apply_chat_template(loaded.tokenizer, prompt_messages(i)) for i in range(seqs)]
    # The whole load, offline: output tokens/s of the engine alone.
    start_load(engine, prompts, max_tokens)
    begin = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    offline_s = time.perf_counter() - begin
    # Again, stopped half way for the breakdown: every sequence decoding.
    start_load(engine, prompts, max_tokens)
    while engine.stats.generation_tokens < seqs * max_tokens + seqs * warm_steps:
        engine.step()
    assert len(engine.scheduler.running) == seqs, "not every sequence is decoding"
    contexts = [s.num_tokens for s in engine.scheduler.running]
    timers = Timers()
    with instrument(engine, timers):
        timers.on = True
        begin = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step_s = (time.perf_counter() - begin) / steps
        timers.on = False
    parts = breakdown({k: v / steps for k, v in timers.seconds.items()}, step_s)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(min(steps, 4)):
            engine.step()
    table = [(e.key, e.self_cpu_time_total / 1e3 / min(steps, 4), e.count // min(steps, 4))
             for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]]
    while engine.has_unfinished_requests():
        engine.step()
    ab = now_vs_before_on_a_full_batch(engine, prompts, rounds, steps=2)
    step_flops = seqs * flops_per_token(loaded.model, sum(contexts) // len(contexts))
    roofline = gemm_roofline(loaded.model.dtype)
    return {"dtype": dtype, "seqs": seqs, "max_tokens": max_tokens, "steps": steps, "ab": ab,
            "step_bytes": step_bytes(loaded.model, contexts), "read_gb_s": read_bandwidth_gb_s(),
            "step_gflops": step_flops / 1e9, "gflop_s": step_flops / step_s / 1e9,
            "product_gflops": seqs * product_flops_per_token(loaded.model) / 1e9,
            "roofline_gflop_s": roofline,
            "context_min": min(contexts), "context_max": max(contexts),
            "step_ms": step_s * 1e3, "decode_tok_s": seqs / step_s,
            "offline_tok_s": seqs * max_tokens / offline_s, "offline_s": offline_s,
            "parts_ms": [(k, v * 1e3) for k, v in parts],
            "profiler_ms": table, "threads": torch.get_num_threads()}


def markdown(rec: dict) -> str:
    m = rec["machine"]
    lines = [f"# Where a decode step's time goes{' (' + rec['tag'] + ')' if rec.get('tag') else ''}",
             "",
             f"Measured {rec['date']} on {m['cpu']} ({m['cores']} cores, {bf16_words(m)}), "
             f"torch {m['torch']}; {rec['minutes']:.1f} min.",
             f"Command: `{rec['command']}`. Engine in process (no HTTP), chapter 06's defaults, "
             f"card {rec['card_gb']} GiB, the load test's prompts, greedy, EOS ignored; "
             f"{rec['runs'][0]['threads']} intra-op threads.",
             "",
             "| dtype | seqs | context | ms / decode step | decode tok/s | whole load offline tok/s |",
             "|---|---|---|---|---|---|"]
    for r in rec["runs"]:
        lines.append(f"| {r['dtype']} | {r['seqs']} | {r['context_min']}-{r['context_max']} | "
                     f"{r['step_ms']:.1f} | {r['decode_tok_s']:.0f} | {r['offline_tok_s']:.0f} |")
    if all("roofline_gflop_s" in r for r in rec["runs"]):
        lines += ["", "Against the roofline: a decode step's arithmetic (2 FLOP per weight of "
                  "every matrix product, plus attention) over its time, next to one large "
                  "(2048 x 2048) matrix product's GFLOP/s in the same dtype on this machine:", "",
                  "| dtype | seqs | GFLOP a step | GFLOP/s | GEMM roofline GFLOP/s | % |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['dtype']} | {r['seqs']} | {r['step_gflops']:.1f} | {r['gflop_s']:.0f} | "
                  f"{r['roofline_gflop_s']:.0f} | {100 * r['gflop_s'] / r['roofline_gflop_s']:.0f} |"
                  for r in rec["runs"]]
    if all("product_gflops" in r for r in rec["runs"]):
        lines += ["", "The limit, per step (issue 50): the step's matrix products (its "
                  "linears and LM head) at the large product's speed above, against the "
                  "step's time; the rest of the step (attention, sampling, scheduling, "
                  "Python) is what keeps it from 100 % (the aim: at least 80 % at 64 "
                  "sequences):", "",
                  "| dtype | seqs | GFLOP of products | ms at the roofline | ms a step | % |",
                  "|---|---|---|---|---|---|"]
        for r in rec["runs"]:
            limit_ms = r["product_gflops"] / r["roofline_gflop_s"] * 1e3
            lines.append(f"| {r['dtype']} | {r['seqs']} | {r['product_gflops']:.1f} | "
                         f"{limit_ms:.1f} | {r['step_ms']:.1f} | "
                         f"{100 * limit_ms / r['step_ms']:.0f} |")
    if all("step_bytes" in r for r in rec["runs"]):
        lines += ["", "Against memory: the bytes a decode step must read (the weights once, "
                  "the K/V it attends) at this machine's read speed (a sum over 256 MiB, "
                  "bench/profiles/gemm_bandwidth.py), over the step's time (issue 35 "
                  "asks for at least 50 % at 64 sequences):", "",
                  "| dtype | seqs | MB a step | read GB/s | ms at that speed | ms a step | % |",
                  "|---|---|---|---|---|---|---|"]
        for r in rec["runs"]:
            floor_ms = r["step_bytes"] / (r["read_gb_s"] * 1e9) * 1e3
            lines.append(f"| {r['dtype']} | {r['seqs']} | {r['step_bytes'] / 1e6:.0f} | "
                         f"{r['read_gb_s']:.1f} | {floor_ms:.1f} | {r['step_ms']:.1f} | "
                         f"{100 * floor_ms / r['step_ms']:.0f} |")
    if any(r.get("ab") for r in rec["runs"]):
        lines += ["", "Each change of issue 22 against its previous version, in turn on the "
                  "same running batch (median ms per decode step):", "",
                  "| dtype | seqs | change | before | now | speed-up |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['dtype']} | {r['seqs']} | {ab['change']} | {ab['before_ms']:.1f} | "
                  f"{ab['now_ms']:.1f} | {ab['speedup']:.2f}x |"
                  for r in rec["runs"] for ab in (r.get("ab") or [])]
    for r in rec["runs"]:
        lines += ["", f"## {r['dtype']}, {r['seqs']} sequences: {r['step_ms']:.1f} ms a step",
                  "", "Wall clock (exclusive parts, ms per step):", "",
                  "| part | ms | % |", "|---|---|---|"]
        lines += [f"| {k} | {v:.2f} | {100 * v / r['step_ms']:.1f} |" for k, v in r["parts_ms"]
                  if abs(v) >= 0.005]
        lines += ["", "torch.profiler, top ops by self CPU time (ms per step, calls per step):",
                  "", "| op | ms | calls |", "|---|---|---|"]
        lines += [f"| `{k}` | {v:.2f} | {c} |" for k, v, c in r["profiler_ms"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--seqs", nargs="+", type=int, default=[32, 64])
    p.add_argument("--max-tokens", type=int, nargs="+", default=None,
                   help="per --seqs entry (default: 64 for 32 sequences, 128 otherwise)")
    p.add_argument("--steps", type=int, default=12, help="decode steps timed")
    p.add_argument("--rounds", type=int, default=4,
                   help="before/now rounds of each change's A/B (2 steps each)")
    p.add_argument("--card", type=float, default=CARD_GB)
    p.add_argument("--tag", default="", help="a suffix for the results file (before/after)")
    add_quiet_run_args(p)
    args = p.parse_args(argv)
    if args.render:
        render_again(args.render, markdown)
        return 0
    wait_for_quiet_machine(args.wait_quiet, args.quiet_load)
    max_tokens = args.max_tokens or [64 if s <= 32 else 128 for s in args.seqs]
    start, runs = time.perf_counter(), []
    for dtype in args.dtypes:
        loaded = load_model("smollm2", dtype, "cpu")
        for seqs, tokens in zip(args.seqs, max_tokens):
            print(f"{dtype}, {seqs} sequences x {tokens} tokens", flush=True)
            runs.append(measure(loaded, dtype, seqs, tokens, args.steps, args.card,
                                warm_steps=tokens // 8, rounds=args.rounds))
    rec = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": machine(), "card_gb": args.card, "tag": args.tag,
           "command": " ".join(["python -m bench.profiles.profile_step",
                                *(sys.argv[1:] if argv is None else argv)]),
           "minutes": (time.perf_counter() - start) / 60, "runs": runs}
    write_results(args.out_dir, f"profile{'-' + args.tag if args.tag else ''}", rec, markdown(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
