"""The sampler: logits -> next token ids (ch03).

Per request: greedy (temperature 0), temperature, top-k, top-p, min-p,
presence/frequency/repetition penalties, logit bias, a seed (a seeded request draws from
its own `torch.Generator`, so it gives the same text whatever else runs in
the batch), and the logprobs of the chosen and top tokens. Also (ch06)
the prompt's own logprobs, with each token's rank (`prompt_token_logprobs`).

One row's failure is that row's alone: the sampler returns a
`SamplingFailed` for it, the engine finishes that request with an error,
and the other rows of the batch get their tokens.

What a request's parameters need is built once, when the request starts
(`RequestSamplingState`, as vLLM V1's persistent batch keeps it), then
updated by one token per step: so a request with a 49,152-entry
`logit_bias`, a long prompt under a repetition penalty or hundreds of
`stop_token_ids` costs the other requests' steps no more than a plain one.

A grammar's mask (ch07, structured outputs) is applied to the logits
before they reach the sampler (common/layers/token_bitmask.py); draft
tokens are checked by common/layers/rejection_sampler.py, which uses the
same per-request state.

Left out: beam search, best_of; rows are sampled one by one, on the CPU
(vLLM samples the whole batch with tensors on the GPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.sampling_params import SamplingParams


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob)
    rank: int | None = None  # 1 + tokens more likely (prompt logprobs only, as vLLM's)


@dataclass
class SamplingFailed:
    """What one row got instead of a token when sampling it raised."""
    error: Exception


class RequestSamplingState:
    """One request's sampling tensors, built once when it is added, then
    updated as it gets each token (`append`). Each is built only if the
    request's parameters need it:

    - `bias`: OpenAI's logit_bias as a dense row, (vocab,);
    - `output_counts`: times each token was generated, (vocab,): the
      presence and frequency penalties;
    - `seen`: tokens of the prompt or the output, (vocab,) bool: the
      repetition penalty;
    - `min_tokens_ban`: the ids that may not end the answer before
      `min_tokens` (EOS and the stop token ids).
    """

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int,
                 eos_token_ids: list[int] = (), generator: torch.Generator | None = None):
        self.params = params
        self.generator = generator
        self.num_output_tokens = 0
        self.bias = self.output_counts = self.seen = self.min_tokens_ban = None
        if params.logit_bias:
            self.bias = torch.zeros(vocab_size)  # (vocab,)
            self.bias[list(params.logit_bias)] = torch.tensor(list(params.logit_bias.values()))
        if params.presence_penalty or params.frequency_penalty:
            self.output_counts = torch.zeros(vocab_size)  # (vocab,)
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # (vocab,)
            self.seen[prompt_ids] = True
        if params.min_tokens and not params.ignore_eos:
            self.min_tokens_ban = torch.tensor(
                sorted(set(eos_token_ids) | set(params.stop_token_ids)), dtype=torch.long)

    def append(self, token_id: int) -> None:
        """The request got `token_id`: one entry of each tensor changes."""
        self.num_output_tokens += 1
        if self.output_counts is not None:
            self.output_counts[token_id] += 1
        if self.seen is not None:
            self.seen[token_id] = True

    def banned_at(self, num_pending: int = 0) -> bool:
        """Are EOS and the stop ids banned at the position `num_pending`
        tokens after the output so far (`min_tokens` not reached)?"""
        return (self.min_tokens_ban is not None
                and self.num_output_tokens + num_pending < self.params.min_tokens)

    @property
    def banned_now(self) -> bool:
        return self.banned_at(0)

    @property
    def plain_greedy(self) -> bool:
        """Nothing to adjust or report: a batched argmax serves this row."""
        return self.params.plain_greedy and not self.banned_now

    def adjust(self, logits: torch.Tensor, pending: list[int] = ()) -> torch.Tensor:
        """logits: (vocab,) -> a new row with the penalties, the bias and
        the ban applied (the repetition penalty, vLLM's and HF's, covers
        prompt and output; OpenAI's presence and frequency penalties count
        the output; the bias is added to the penalized logits).

        `pending` (ch07, speculative decoding): draft tokens that come
        before this row's position and count as output if this row is
        reached (they are accepted by then), as vLLM's rejection sampler
        counts them; the state itself is not changed."""
        p = self.params
        ids = torch.tensor(list(pending), dtype=torch.long) if pending else None  # (num_pending,)
        if self.seen is not None:
            seen = self.seen if ids is None else self.seen.index_fill(0, ids, True)
            penalized = torch.where(logits > 0, logits / p.repetition_penalty,
                                    logits * p.repetition_penalty)
            logits = torch.where(seen, penalized, logits)
        if self.output_counts is not None:
            counts = self.output_counts
            if ids is not None:
                counts = counts.index_add(0, ids, torch.ones(len(ids)))
            logits = logits - p.frequency_penalty * counts
            logits = logits - p.presence_penalty * (counts > 0).float()
        if self.bias is not None:
            logits = logits + self.bias
        if self.banned_at(len(pending)):
            logits = logits.index_fill(0, self.min_tokens_ban, float("-inf"))
        return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: (vocab,), already divided by the temperature. Tokens outside
    top-k, top-p (nucleus) or min-p get -inf."""
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p.
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: (vocab,), adjusted -> the distribution a sampled (not greedy)
    row draws from: temperature, then top-k, top-p, min-p, then softmax.
    The rejection sampler (ch07) checks drafts against this same p."""
    return torch.softmax(filter_logits(logits / params.temperature, params), dim=-1)


def sampled_token(logprobs: torch.Tensor, token_id: int, k: int | None) -> SampledToken:
    if k is None:
        return SampledToken(token_id)
    top = torch.topk(logprobs, k) if k > 0 else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return SampledToken(token_id, float(logprobs[token_id]), pairs)


def prompt_token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int
                          ) -> list[SampledToken]:
    """logits: (n, vocab), row i predicting `token_ids[i]` (a prompt token)
    -> each token's logprob and rank and the `k` top logprobs (-1: all),
    from the raw logits, as vLLM's prompt logprobs."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (n, vocab)
    ids = torch.tensor(token_ids, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])  # (n, 1)
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # (n,)
    k = logprobs.shape[-1] if k == -1 else k
    top = torch.topk(logprobs, k) if k > 0 else None
    out = []
    for i, token_id in enumerate(token_ids):
        pairs = (list(zip(top.indices[i].tolist(), top.values[i].tolist()))
                 if top is not None else [])
        out.append(SampledToken(token_id, float(chosen[i]), pairs, int(ranks[i])))
    return out


class Sampler:
    """Pick one token per row of logits, each row with its own request's state."""

    def __call__(self, logits: torch.Tensor, states: list[RequestSamplingState]
                 ) -> list[SampledToken | SamplingFailed]:
        """logits: (num_seqs, vocab); `states[i]`: row i's request."""
        results: list[SampledToken | SamplingFailed | None] = [None] * len(states)
        # Plain greedy rows (no penalty, bias, ban or logprobs) need only an
        # argmax: one call for all of them instead of one per row, in the
        # logits' own dtype (bfloat16 -> float32 is exact: the same argmax).
        # ch05: written as max(...).indices, the same index (the first of
        # equal maxima), and argmax in bfloat16 is slow on the CPU: 1.07x a
        # decode step of 64 sequences against argmax on float32 logits
        # (bench/results/2026-12-02-vm-profile.md).
        plain = [i for i, state in enumerate(states) if state.plain_greedy]
        if plain:
            rows = logits if len(plain) == len(states) else logits[plain]
            tokens = rows.max(dim=-1).indices.tolist()  # (num_plain,)
            for i, token in zip(plain, tokens):
                results[i] = SampledToken(token)
        if len(plain) == len(states):
            return results
        # The other rows' logits to the host, on purpose: each seeded request
        # draws from its own CPU torch.Generator, so that a seed gives the same
        # tokens on a GPU machine and on a CPU one, whatever else is in the
        # batch (a CUDA generator's stream differs). One copy of (num_seqs, vocab).
        logits = logits.float().cpu()
        for i, state in enumerate(states):
            if results[i] is None:
                try:
                    results[i] = self._sample_row(logits[i], state)
                except Exception as exc:  # noqa: BLE001 - this row's error, not the batch's
                    results[i] = SamplingFailed(exc)
        return results

    @staticmethod
    def _sample_row(row: torch.Tensor, state: RequestSamplingState) -> SampledToken:
        """row: (vocab,) logits of one sequence -> its token (and logprobs)."""
        p = state.params
        row = state.adjust(row)
        logprobs = torch.log_softmax(row, dim=-1) if p.logprobs is not None else None
        if p.greedy:
            token = int(torch.argmax(row))
        else:
            token = int(torch.multinomial(sampling_probs(row, p), 1, generator=state.generator))
        return sampled_token(logprobs, token, p.logprobs)
