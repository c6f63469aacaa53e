"""Exercise 07b: the rejection sampler of speculative decoding.

A speculating sequence feeds its last token plus k draft tokens
d_1..d_k (guessed by the n-gram proposer, common/spec_decode/ngram_proposer.py)
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

Graded by `make exercise CH=07b` (the tests marked `ex07b` in
tests/test_speculative.py, which call your function: over 20,000 trials
the first token emitted follows p, and after an accepted draft the next
one follows the next row; one-hot rows behave as greedy, with the bonus
token, and a seeded generator replays). exercises/README-07b.md has the
tasks and the hints; a failing test names the hint to read first. Once
every test passes, compare your function with `rejection_sample` in
common/layers/rejection_sampler.py, the one the engine runs.

Left out on purpose, although the course's module has them:
`greedy_verify` (greedy requests skip this rule: a draft is accepted
exactly when it is the argmax) and `RejectionSampler`, which turns each
sequence's k + 1 rows of logits into `target_probs` (penalties,
temperature, top-k/p, the grammar's mask) and returns tokens with their
logprobs. The exercise is the rule itself; the rest is the plain
sampler's work, done the same way. Left out of both: drafts with a
distribution of their own (a draft model's q: accept with min(1, p / q),
residual max(0, p - q)), a batched GPU kernel (vLLM's are in Triton),
tree attention.
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
    # Never write into target_probs: it belongs to the caller.
    # Stuck? exercises/README-07b.md, hints 1 to 5.
    raise NotImplementedError("rejection_sample: accept each draft with probability p(d), "
                              "resample from p without d at the first rejection, or add a "
                              "bonus token from the last row")
