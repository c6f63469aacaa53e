"""The autoregressive loop by hand, with no KV cache (ch01).

Each new token re-runs the model over the *whole* sequence so far: step t
costs a forward pass over prompt + t tokens, so n new tokens cost O(n^2)
token-forwards. That is the baseline the KV cache (chapter 03) removes.

Left out: batching, top-k/top-p and penalties (common/layers/sampler.py, ch03).
"""
from __future__ import annotations

import torch

from common.sampling_params import SAMPLING_EPS


def sample_next_token(logits: torch.Tensor, temperature: float,
                      generator: torch.Generator | None = None) -> int:
    """logits: (vocab,). Greedy at temperature 0 (below SAMPLING_EPS), else
    softmax sampling."""
    if temperature < SAMPLING_EPS:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (vocab,)
    return int(torch.multinomial(probs, num_samples=1, generator=generator))


@torch.no_grad()
def generate_without_cache(model, prompt_ids: list[int], max_new_tokens: int,
                           temperature: float = 0.0, eos_token_ids: set[int] = frozenset(),
                           seed: int | None = None) -> tuple[list[int], str]:
    """Generate up to `max_new_tokens` tokens. Returns (new ids, finish reason)."""
    device = next(model.parameters()).device
    generator = None
    if seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(seed)
    token_ids = list(prompt_ids)
    new_ids: list[int] = []
    for _ in range(max_new_tokens):
        input_ids = torch.tensor([token_ids], device=device)  # (1, seq_len)
        logits = model(input_ids).logits[0, -1]  # (vocab,): only the last position
        next_id = sample_next_token(logits.cpu(), temperature, generator)
        new_ids.append(next_id)
        token_ids.append(next_id)
        if next_id in eos_token_ids:
            return new_ids, "stop"
    return new_ids, "length"


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every token id that ends a reply: the tokenizer's and generation config's."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    return ids
