"""The sampler: logits -> next token ids (ch03).

Per request: greedy (temperature 0), temperature, top-k, top-p, min-p,
presence/frequency/repetition penalties, logit bias, a seed (a seeded request draws from
its own `torch.Generator`, so it gives the same text whatever else runs in
the batch), and the logprobs of the chosen and top tokens.

One row's failure is that row's alone: the sampler returns a
`SamplingFailed` for it, the engine finishes that request with an error,
and the other rows of the batch get their tokens.

Left out: beam search, best_of, guided decoding; penalties are recounted
from the token lists at every step (vLLM keeps count tensors on the GPU).
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


@dataclass
class SamplingFailed:
    """What one row got instead of a token when sampling it raised."""
    error: Exception


def apply_penalties(logits: torch.Tensor, params: SamplingParams,
                    prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """logits: (vocab,). OpenAI's presence/frequency penalties count output
    tokens; the repetition penalty (vLLM, HF) covers prompt and output."""
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                   values * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.tensor(output_ids).unique(return_counts=True)
        logits[ids] -= params.frequency_penalty * counts.to(logits.dtype)
        logits[ids] -= params.presence_penalty
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


def _top_logprobs(logprobs: torch.Tensor, token_id: int, k: int | None) -> SampledToken:
    if k is None:
        return SampledToken(token_id)
    top = torch.topk(logprobs, k) if k > 0 else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return SampledToken(token_id, float(logprobs[token_id]), pairs)


class Sampler:
    """Pick one token per row of logits, each row with its own parameters."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 prompt_ids: list[list[int]], output_ids: list[list[int]],
                 banned: list[list[int]] | None = None) -> list[SampledToken | SamplingFailed]:
        """logits: (num_seqs, vocab). `banned[i]`: token ids that row i may not
        pick now (EOS before `min_tokens`)."""
        logits = logits.float().cpu()
        banned = banned or [[] for _ in params]
        results: list[SampledToken | SamplingFailed | None] = [None] * len(params)
        # Plain greedy rows (no penalty, bias, ban or logprobs) need only an
        # argmax: one call for all of them instead of one per row.
        plain = [i for i, p in enumerate(params) if p.plain_greedy and not banned[i]]
        if plain:
            rows = logits if len(plain) == len(params) else logits[plain]
            tokens = rows.argmax(dim=-1).tolist()  # (num_plain,)
            for i, token in zip(plain, tokens):
                results[i] = SampledToken(token)
        for i, p in enumerate(params):
            if results[i] is None:
                try:
                    results[i] = self._sample_row(logits[i], p, generators[i], prompt_ids[i],
                                                  output_ids[i], banned[i])
                except Exception as exc:  # noqa: BLE001 - this row's error, not the batch's
                    results[i] = SamplingFailed(exc)
        return results

    @staticmethod
    def _sample_row(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None,
                    prompt_ids: list[int], output_ids: list[int],
                    banned: list[int]) -> SampledToken:
        """row: (vocab,) logits of one sequence -> its token (and logprobs)."""
        if p.needs_penalties:
            row = apply_penalties(row, p, prompt_ids, output_ids)
        if p.logit_bias or banned:
            row = row.clone()
        if p.logit_bias:  # OpenAI's logit_bias: added to the penalized logits
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)
        if banned:
            row[banned] = float("-inf")
        logprobs = torch.log_softmax(row, dim=-1) if p.logprobs is not None else None
        if p.greedy:
            token = int(torch.argmax(row))
        else:
            probs = torch.softmax(filter_logits(row / p.temperature, p), dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        return _top_logprobs(logprobs, token, p.logprobs)
