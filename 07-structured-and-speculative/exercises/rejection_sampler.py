"""Exercise 07b: the rejection sampler of speculative decoding.

A speculating sequence feeds its last token plus k draft tokens
d_1..d_k (guessed by the n-gram proposer, common/engine/ngram_proposer.py)
as one short prefill chunk. The forward pass gives k + 1 rows: row j is
the model's next-token distribution p_j after the tokens up to d_j
(row 0: after the sequence's last real token). You write the rule that
turns those rows and the drafts into the tokens the step emits, such
that **each emitted token has exactly the distribution it would have had
without speculation**:

    for j = 1..k:
        accept d_j with probability p_{j-1}(d_j)        (a uniform u < p)
        on the first rejection: sample from p_{j-1} with d_j removed
        (renormalized), emit it, and stop
    all k accepted: emit a bonus token sampled from p_k (the last row)

So a step emits between 1 and k + 1 tokens. Why the first token is
exact: P(emit t) = p(d) [t = d] + (1 - p(d)) p(t) [t != d] / (1 - p(d))
= p(t). This is the speculative sampling rule (Leviathan et al. 2023,
Chen et al. 2023) for a draft that is one-hot (q(d) = 1), as an n-gram
proposal is and as vLLM treats it.

The engine's `RejectionSampler` (common/layers/rejection_sampler.py)
builds `target_probs` (penalties, temperature, top-k/p and the grammar's
mask already applied: the same p as the plain sampler would use) and
calls `rejection_sample` for each sequence that is sampled, not greedy.

Graded by `make exercise CH=07b` (the 3 tests marked `ex07b` in
tests/test_speculative.py, which call your function: over 20,000 trials
the first token emitted follows p, and after an accepted draft the next
one follows the next row; one-hot rows behave as greedy, with the bonus
token, and a seeded generator replays). The reference is
`rejection_sample` in common/layers/rejection_sampler.py: peek only when
stuck. exercises/README-07b.md has the tasks and hints.

Left out, as in the reference: drafts with a distribution of their own
(a draft model's q: accept with min(1, p / q), residual max(0, p - q)),
a batched GPU kernel (vLLM's are in Triton), tree attention.
"""
from __future__ import annotations

import torch


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: list[int],
                     generator: torch.Generator | None = None) -> list[int]:
    """target_probs: (k + 1, vocab) float32 on the CPU, each row sums to 1;
    row j is the distribution after draft j (row 0: after the sequence's
    last real token). draft_token_ids: the k drafts (k may be 0).
    generator: the request's own `torch.Generator` (None: torch's global
    one); draw every random number from it, so a seeded request replays.

    Returns the accepted drafts, then one more token: the replacement
    sampled at the first rejection, or the bonus token from the last row
    when all k are accepted. Between 1 and k + 1 ids, as Python ints.
    """
    # Hints (README-07b.md has more):
    # - draft j (0-based in the list) is checked against row j:
    #   target_probs[j][draft] is p_{j-1}(d_j) of the rule above.
    # - a uniform number: torch.rand((), generator=generator), one per
    #   draft checked, in order.
    # - sampling from a row: torch.multinomial(row, 1, generator=generator);
    #   it renormalizes for you, so "p with d removed" is a copy of the row
    #   with that one entry set to 0 (clone first: never change target_probs).
    # - stop at the first rejection: the rows after it are not used.
    raise NotImplementedError("rejection_sample: accept each draft with probability p(d), "
                              "resample from p without d at the first rejection, or add a "
                              "bonus token from the last row")
