"""The rejection sampler (ch07, speculative decoding): draft tokens checked
in one forward pass, keeping the model's own distribution.

A speculating sequence feeds its last token plus k draft tokens d_1..d_k
(common/spec_decode/ngram_proposer.py) as one short prefill chunk, so the
forward pass gives k + 1 rows of logits: row j is the model's next-token
distribution p_j after the tokens up to d_j. Then, for j = 1..k:

- greedy: accept d_j while it is the argmax of row j - 1; at the first
  mismatch emit that argmax instead and stop;
- sampled: accept d_j with probability p_{j-1}(d_j). On the first
  rejection, sample from p_{j-1} with d_j removed and renormalized, and
  stop. This is the speculative sampling rule (Leviathan et al. 2023,
  Chen et al. 2023) for a draft that is one-hot, q(d_j) = 1, as an n-gram
  proposal is and as vLLM treats it: accept with min(1, p / q) = p, on
  rejection sample from max(0, p - q), normalized.

If all k are accepted, a bonus token is sampled from the last row. So a
step emits between 1 and k + 1 tokens, and **each has exactly the
distribution it would have had without speculation**: P(emit t) =
p(d) [t = d] + (1 - p(d)) * p(t) [t != d] / (1 - p(d)) = p(t). Greedy
text is unchanged token for token; a test checks the sampled rule
statistically (tests/test_speculative.py).

p is the distribution after everything the plain sampler applies:
penalties counting the earlier drafts as output (`RequestSamplingState.adjust`
with `pending`), the bias, the min_tokens ban, temperature, top-k/p,
min-p, and the grammar's mask (applied to the logits before, ch07).
Each request draws from its own generator: a seeded request replays.

vLLM's file: vllm/v1/sample/rejection_sampler.py (batched on the GPU,
with Triton kernels); here one sequence at a time, on the CPU.

Left out: drafts with a distribution of their own (a draft model's q,
where the residual is max(0, p - q)), tree attention over several drafts.
"""
from __future__ import annotations

import torch

from common.layers.sampler import (
    RequestSamplingState,
    SampledToken,
    SamplingFailed,
    sampled_token,
    sampling_probs,
)


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: list[int],
                     generator: torch.Generator | None = None) -> list[int]:
    """target_probs: (k + 1, vocab), row j the distribution after draft j
    (row 0: after the sequence's last real token); draft_token_ids: the k
    drafts. Returns the accepted drafts and one more token: a replacement
    sampled from the residual at the first rejection, or a bonus token from
    the last row when all k are accepted (between 1 and k + 1 ids)."""
    tokens = []
    for j, draft in enumerate(draft_token_ids):
        probs = target_probs[j]  # (vocab,)
        if torch.rand((), generator=generator) < probs[draft]:  # accept with p(d)
            tokens.append(draft)
            continue
        residual = probs.clone()
        residual[draft] = 0.0  # p with d removed; multinomial renormalizes
        tokens.append(int(torch.multinomial(residual, 1, generator=generator)))
        return tokens
    tokens.append(int(torch.multinomial(target_probs[-1], 1, generator=generator)))  # bonus
    return tokens


def greedy_verify(target_token_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """Greedy: the argmax of each of the k + 1 rows; drafts accepted while
    they equal it. Returns the accepted drafts and one more argmax."""
    tokens = []
    for draft, target in zip(draft_token_ids, target_token_ids):
        tokens.append(target)
        if draft != target:
            return tokens
    tokens.append(target_token_ids[len(draft_token_ids)])  # bonus
    return tokens


class RejectionSampler:
    """Check each speculating sequence's drafts against its k + 1 rows of logits."""

    def __call__(self, logits: torch.Tensor, states: list[RequestSamplingState],
                 draft_token_ids: list[list[int]]) -> list[list[SampledToken] | SamplingFailed]:
        """logits: (sum of (k_i + 1), vocab), sequence i's rows consecutive;
        `states[i]`, `draft_token_ids[i]`: sequence i's request and its k_i drafts."""
        results: list[list[SampledToken] | SamplingFailed] = []
        start = 0
        plain_targets = None
        if any(state.plain_greedy for state in states):  # one argmax for every row
            plain_targets = logits.max(dim=-1).indices.tolist()  # (num_rows,)
        host_logits = None
        for state, drafts in zip(states, draft_token_ids):
            end = start + len(drafts) + 1
            try:
                if state.plain_greedy:
                    tokens = greedy_verify(plain_targets[start:end], drafts)
                    results.append([SampledToken(t) for t in tokens])
                else:
                    if host_logits is None:  # one copy to the host, as the Sampler
                        host_logits = logits.float().cpu()
                    results.append(self._verify(host_logits[start:end], state, drafts))
            except Exception as exc:  # noqa: BLE001 - this sequence's error only
                results.append(SamplingFailed(exc))
            start = end
        return results

    @staticmethod
    def _verify(rows: torch.Tensor, state: RequestSamplingState,
                drafts: list[int]) -> list[SampledToken]:
        """rows: (k + 1, vocab) logits of one sequence -> its emitted tokens."""
        p = state.params
        adjusted = torch.stack([state.adjust(row, drafts[:j])  # (k + 1, vocab)
                                for j, row in enumerate(rows)])
        if p.greedy:
            tokens = greedy_verify(adjusted.argmax(dim=-1).tolist(), drafts)
        else:
            probs = torch.stack([sampling_probs(row, p) for row in adjusted])  # (k + 1, vocab)
            tokens = rejection_sample(probs, drafts, state.generator)
        if p.logprobs is None:
            return [SampledToken(t) for t in tokens]
        logprobs = torch.log_softmax(adjusted, dim=-1)  # as the Sampler: before temperature
        return [sampled_token(logprobs[j], t, p.logprobs) for j, t in enumerate(tokens)]
