"""Exercise 07b, predict then measure: is the rejection sampler lossless,
how many tokens does a step emit, and what does checking drafts cost
(solutions-07b.md has the answers).

    python 07-structured-and-speculative/exercises/measure_rejection_sampler.py

1. A toy distribution p over 5 tokens and one draft, d = 3 (p(d) = 0.1),
   20,000 trials: how often each token comes out first, with the rule
   (the reference, and yours once written) and without the residual
   correction (on a rejection, resample from p itself, d included).
2. K = 4 drafts whose every row gives the draft probability a: the mean
   number of tokens a step emits, against (1 - a^(K+1)) / (1 - a).
3. One forward pass of the embedded model (Hugging Face's, float32, a
   cache of 100 tokens) that feeds 1 token, then K + 1 = 5: what a verify
   step costs on this machine.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from common.layers.rejection_sampler import rejection_sample  # noqa: E402

P = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
DRAFT, TRIALS = 3, 20_000


def without_residual(target_probs: torch.Tensor, draft_token_ids: list[int],
                     generator: torch.Generator | None = None) -> list[int]:
    """The rule with one mistake: a rejected draft is resampled from p
    itself, the draft still in it."""
    tokens = []
    for j, draft in enumerate(draft_token_ids):
        if torch.rand((), generator=generator) < target_probs[j][draft]:
            tokens.append(draft)
            continue
        tokens.append(int(torch.multinomial(target_probs[j], 1, generator=generator)))
        return tokens
    tokens.append(int(torch.multinomial(target_probs[-1], 1, generator=generator)))
    return tokens


def learners_function():
    """Yours, from rejection_sampler.py beside this file, or None while it is a stub."""
    from tests.components import load_exercise
    fn = load_exercise("07b").rejection_sample
    try:
        fn(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), [0], torch.Generator().manual_seed(0))
    except NotImplementedError:
        return None
    return fn


def first_token_frequencies(rule) -> list[float]:
    gen = torch.Generator().manual_seed(0)
    rows = torch.stack([P, P])  # (k + 1, vocab) = (2, 5)
    counts = [0] * len(P)
    for _ in range(TRIALS):
        counts[rule(rows, [DRAFT], gen)[0]] += 1
    return [c / TRIALS for c in counts]


def lossless() -> None:
    rules = {"the rule (reference)": rejection_sample, "without the residual": without_residual}
    mine = learners_function()
    if mine is not None:
        rules["yours"] = mine
    stderr = max((p * (1 - p) / TRIALS) ** 0.5 for p in P.tolist())
    print(f"1. first token emitted, {TRIALS} trials, draft d = {DRAFT} "
          f"(one standard error <= {stderr:.4f})")
    print("   " + " " * 22 + "  ".join(f"  t={t}" for t in range(len(P))))
    print("   " + f"{'p (target)':22s}" + "  ".join(f"{p:5.3f}" for p in P.tolist()))
    for name, rule in rules.items():
        freqs = first_token_frequencies(rule)
        print("   " + f"{name:22s}" + "  ".join(f"{f:5.3f}" for f in freqs))
    if mine is None:
        print("   (yours: still a stub, not run)")
    p_d = P[DRAFT].item()
    print(f"   without the residual, P(d) = p(d) + (1 - p(d)) p(d) = {p_d + (1 - p_d) * p_d:.3f}")


def tokens_per_step(a: float, k: int, trials: int = TRIALS) -> float:
    """Mean tokens a step emits when each draft has probability a in its row."""
    vocab = 4
    row = torch.full((vocab,), (1 - a) / (vocab - 1))
    row[0] = a  # every draft is token 0
    rows = row.expand(k + 1, vocab).contiguous()  # (k + 1, vocab)
    gen = torch.Generator().manual_seed(1)
    return sum(len(rejection_sample(rows, [0] * k, gen)) for _ in range(trials)) / trials


def acceptance() -> None:
    k = 4
    print(f"\n2. K = {k} drafts, each accepted with probability a: tokens per step, "
          f"{TRIALS} steps each")
    for a in (0.3, 0.5, 0.7, 0.9):
        formula = (1 - a ** (k + 1)) / (1 - a)
        print(f"   a = {a}: measured {tokens_per_step(a, k):.3f}, "
              f"(1 - a^{k + 1}) / (1 - a) = {formula:.3f}")


def forward_cost(runs: int = 50) -> None:
    from common.loader import load_model
    model = load_model("smollm2", dtype="float32", device="cpu").model
    gen = torch.Generator().manual_seed(2)
    context = torch.randint(100, 10_000, (1, 100), generator=gen)
    with torch.no_grad():
        cache = model(context, use_cache=True).cache  # a DynamicCache
        print(f"\n3. one forward pass with a cache of {context.shape[1]} tokens "
              f"(HF, float32, {torch.get_num_threads()} threads), median of {runs}:")
        times: dict[int, list[float]] = {1: [], 5: []}
        for run in range(runs + 3):  # the first 3 warm up; 1 and 5 in turn
            for new in times:
                ids = torch.randint(100, 10_000, (1, new), generator=gen)
                start = time.perf_counter()
                model(ids, cache=cache, use_cache=True)
                if run >= 3:
                    times[new].append(time.perf_counter() - start)
                cache.crop(-new)  # back to the 100 tokens
        for new, measured in times.items():
            print(f"   {new} new token(s): {statistics.median(measured) * 1e3:.1f} ms")


def main() -> None:
    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load average",
          os.getloadavg()[0], "\n")
    lossless()
    acceptance()
    forward_cost()


if __name__ == "__main__":
    main()
