"""Exercise 01: the autoregressive loop by hand, with no KV cache.

You write the two functions chapter 01's server runs for every request:

1. `sample_next_token`: one row of logits -> one token id (greedy at
   temperature 0, otherwise a draw from softmax(logits / temperature)).
2. `generate_without_cache`: the loop. Run the model over the *whole*
   sequence, keep the last row of logits, pick a token, append it, repeat,
   until `max_new_tokens` tokens or an end-of-sequence token.

Graded by `make exercise CH=01` (the tests marked `ex01` in
tests/test_ch01_foundation.py): greedy must give exactly the tokens of HF
`model.generate`, the loop must stop at the right place with the right
finish reason, and sampling must be greedy, seedable and temperature-aware.

exercises/README.md has the hints; a failing test names the hint to
read first. Once every test passes, compare your functions with
common/autoregressive.py, the loop chapter 01's server runs.

Left out on purpose: the KV cache (chapter 03: here every step recomputes
the whole sequence, O(n^2) token-forwards for n new tokens), batching,
top-k / top-p and penalties (common/layers/sampler.py, chapter 03).
Left out too, although common/autoregressive.py has it: `eos_token_ids`,
which reads the ids that end a reply from the tokenizer and the
generation config; the tests and the server compute them and hand them
to your loop as `eos_token_ids`.
"""
from __future__ import annotations

import torch


def sample_next_token(logits: torch.Tensor, temperature: float,
                      generator: torch.Generator | None = None) -> int:
    """Pick the next token id from one row of logits.

    logits: (vocab,), one score per vocabulary entry (a score of -inf means
        "never this token").
    temperature: 0.0 means greedy: the id with the highest logit. Above 0,
        divide the logits by `temperature`, turn them into probabilities
        with a softmax and draw one id at random from them.
    generator: a seeded `torch.Generator` to draw with, or None for torch's
        global one. The same seed must replay the same draws.

    Returns a plain Python int.
    """
    # Stuck? exercises/README.md, hint 2.
    raise NotImplementedError(
        "sample_next_token: return argmax(logits) at temperature 0, otherwise one "
        "draw from softmax(logits / temperature) with `generator`")


@torch.no_grad()
def generate_without_cache(model, prompt_ids: list[int], max_new_tokens: int,
                           temperature: float = 0.0, eos_token_ids: set[int] = frozenset(),
                           seed: int | None = None) -> tuple[list[int], str]:
    """Generate up to `max_new_tokens` tokens after `prompt_ids`, no cache.

    model: a Hugging Face causal LM (`model(input_ids).logits` has shape
        (batch, seq_len, vocab)).
    prompt_ids: the prompt's token ids (the chat template already applied).
    max_new_tokens: the most tokens to generate.
    temperature: passed to `sample_next_token` (0.0: greedy).
    eos_token_ids: ids that end the reply. The end-of-sequence token itself
        is part of the answer: append it, then stop.
    seed: None, or an int that makes sampling repeatable: build one
        `torch.Generator` seeded with it and use it for every draw.

    Returns (new_ids, finish_reason): the generated ids only (not the
    prompt), and "stop" if the last one is an end-of-sequence token,
    "length" if the loop ran out of `max_new_tokens`.
    """
    # The model may sit on a GPU: build input_ids on its device
    # (next(model.parameters()).device). Stuck? exercises/README.md, hints 1, 3 and 4.
    raise NotImplementedError(
        "generate_without_cache: loop max_new_tokens times: run the model on the whole "
        "sequence, sample from the last row of logits, append; stop after an EOS id")
