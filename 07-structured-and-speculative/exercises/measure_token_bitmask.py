"""Exercise 07a, predict then measure: what a grammar's mask costs, and
how many tokens it leaves (solutions.md has the answers).

    python 07-structured-and-speculative/exercises/measure_token_bitmask.py

1. The cost of applying a mask to 32 rows of 49,152 float32 logits: the
   reference (common/layers/token_bitmask.py), xgrammar's own
   `apply_token_bitmask_inplace` (its C++ loop on the CPU), and yours
   (token_bitmask.py here) once it is written. Median of 50 runs each.
2. The embedded model's tokenizer and one JSON schema: how many of the
   49,152 tokens the grammar allows at each position of the answer
   `{"answer": "yes"}`, and which ones when they are few.
3. The model itself, greedy, with that schema (the offline `LLM`): its
   tokens, and with `max_tokens` too small, `finish_reason` "length".
"""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import xgrammar as xgr  # noqa: E402

from common.layers import token_bitmask  # noqa: E402

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"]}
VOCAB, RUNS = 49152, 50


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in
                subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                if line.startswith("Model name")), platform.processor())
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    bf16 = sorted(flags & {"amx_bf16", "avx512_bf16"}) or ["none"]
    return (f"{cpu}, {os.cpu_count()} cores, bfloat16 flags: {', '.join(bf16)}; "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads")


def learners_function():
    """Yours, from token_bitmask.py beside this file, or None while it is a stub."""
    from tests.components import load_exercise
    fn = load_exercise("07a").apply_token_bitmask
    try:
        fn(torch.zeros(1, 32), torch.full((1, 1), -1, dtype=torch.int32))
    except NotImplementedError:
        return None
    return fn


def median_us(candidates: dict, logits: torch.Tensor, bitmask: torch.Tensor) -> dict:
    """Median time of each `apply(copy, bitmask)` in microseconds (the copy
    untimed), the candidates in turn at every run: a busy machine slows
    them alike."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(RUNS):
        for name, apply in candidates.items():
            work = logits.clone()
            start = time.perf_counter()
            apply(work, bitmask)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def timing(rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, VOCAB, generator=gen)  # (rows, 49152) float32
    words = -(-VOCAB // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=gen,
                            dtype=torch.int64).to(torch.int32)  # about half the bits set
    candidates = {"reference (common/layers/token_bitmask.py)": token_bitmask.apply_token_bitmask,
                  "xgrammar apply_token_bitmask_inplace": xgr.apply_token_bitmask_inplace}
    mine = learners_function()
    if mine is not None:
        candidates["yours (exercises/token_bitmask.py)"] = mine
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask)
    print(f"1. applying a random mask to ({rows}, {VOCAB}) float32 logits, median of {RUNS}:")
    medians = median_us(candidates, logits, bitmask)
    for name, apply in candidates.items():
        work = logits.clone()
        apply(work, bitmask)
        same = torch.equal(work, expected)
        print(f"   {name:45s} {medians[name]:8.0f} us   same as xgrammar: {same}")
    if mine is None:
        print("   (yours: still a stub, not timed)")


def show(tok, ids: list[int], limit: int = 12) -> str:
    """The allowed tokens' text when they are few; else how many are
    whitespace only, and the others when they are few."""
    texts = [tok.decode([i]) for i in ids]
    if len(texts) <= limit:
        return "  " + " ".join(map(repr, texts))
    blank = sum(1 for t in texts if not t.strip())
    others = [t for t in texts if t.strip()]
    shown = " ".join(map(repr, others)) if len(others) <= limit else f"{len(others)} others"
    return f"  {blank} whitespace-only tokens, and {shown}"


def allowed_ids(grammar, bitmask: torch.Tensor) -> list[int]:
    grammar.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, VOCAB)
    token_bitmask.apply_token_bitmask(logits, bitmask)
    return (logits[0] == 0).nonzero().flatten().tolist()


def fill_us(grammar, bitmask: torch.Tensor) -> tuple[float, float]:
    """The matcher's time to fill one row: the first fill in this state,
    then the median of RUNS more (xgrammar may reuse its work)."""
    times = []
    for _ in range(RUNS + 1):
        start = time.perf_counter()
        grammar.fill_bitmask(bitmask, 0)
        times.append(time.perf_counter() - start)
    return times[0] * 1e6, statistics.median(times[1:]) * 1e6


def worked_example(loaded) -> None:
    from common.autoregressive import eos_token_ids
    from common.structured_output.manager import StructuredOutputManager
    from common.sampling_params import StructuredOutputsParams
    tok = loaded.tokenizer
    eos = sorted(eos_token_ids(loaded.model, tok))
    manager = StructuredOutputManager(tok, loaded.model.config.vocab_size, eos)
    start = time.perf_counter()
    manager.compile(StructuredOutputsParams(json=SCHEMA))  # the first time: a real compile
    compile_ms = (time.perf_counter() - start) * 1e3
    grammar = manager.grammar_for(StructuredOutputsParams(json=SCHEMA))  # a cache hit
    bitmask = token_bitmask.allocate_token_bitmask(1, VOCAB)
    print(f"\n2. schema {SCHEMA}\n   EOS: {eos} {tok.convert_ids_to_tokens(eos)}; fill: the "
          f"matcher's time to fill one row of the mask there, once, then the median of "
          f"{RUNS} more; the schema compiled in {compile_ms:.1f} ms")
    answer = tok.encode('{"answer": "yes"}', add_special_tokens=False) + eos
    text = ""
    for token in answer:
        first, again = fill_us(grammar, bitmask)  # first: before anything else fills here
        ids = allowed_ids(grammar, bitmask)
        eos_ok = "EOS allowed" if any(e in ids for e in eos) else "no EOS"
        print(f"   after {text!r:22s} {len(ids):6d} of {VOCAB} allowed, {eos_ok}, fill "
              f"{first:3.0f} us then {again:3.0f} us;{show(tok, ids)}")
        assert grammar.accept_token(token), (text, token)
        text += tok.decode([token]) if token not in eos else "<EOS>"
    print(f"   after {text!r}: terminated {grammar.is_terminated}; the tokens were "
          f"{[tok.decode([t]) for t in answer]}")


def generate(loaded) -> None:
    from common.entrypoints.llm import LLM
    from common.sampling_params import SamplingParams, StructuredOutputsParams
    llm = LLM(loaded=loaded, dtype="float32", device="cpu")
    question = [{"role": "user", "content": "Is Paris the capital of France? Answer in JSON."}]
    print("\n3. the model, greedy, on", question[0]["content"])
    for max_tokens in (32, 3):
        for constrained in (False, True):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=(
                StructuredOutputsParams(json=SCHEMA) if constrained else None))
            out = llm.chat(question, params, use_tqdm=False)[0].outputs[0]
            tokens = [loaded.tokenizer.decode([t]) for t in out.token_ids]
            print(f"   max_tokens {max_tokens:2d}, {'schema' if constrained else 'free'}: "
                  f"{out.text!r}, finish_reason {str(out.finish_reason.value)!r}, tokens {tokens}")


def main() -> None:
    from common.loader import load_model
    print(machine(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
          "load average", os.getloadavg()[0], "\n")
    timing(32)
    timing(1)
    loaded = load_model("smollm2", dtype="float32", device="cpu")
    worked_example(loaded)
    generate(loaded)


if __name__ == "__main__":
    main()
