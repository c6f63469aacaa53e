"""The n-gram proposer (ch07, `--speculative-config '{"method": "ngram", ...}'`).

Prompt lookup: text that repeats its context (an answer quoting its
prompt, code edited in place, a list that follows a pattern) can be
guessed without a second model. Take the sequence's last n tokens, look
for the most recent earlier place where the same n tokens appeared, and
propose the tokens that followed them there:

    tokens:  the cat sat on the mat . the cat
    last 2:  "the cat"  -> found at 0 -> propose "sat on the ..."

n runs from `prompt_lookup_max` down to `prompt_lookup_min` (a longer
match is a better guess); no match proposes nothing, and the sequence
decodes one token as usual. Where the copy reaches the end of the text
(the match is recent, or overlaps the last tokens, as in "ha ha ha"), it
goes on copying what it has just proposed: the text is taken to repeat
with the same period, so a run still gets k drafts. The proposals are only guesses: one forward
pass then checks them all (common/layers/rejection_sampler.py), so a
wrong guess costs compute, never correctness.

vLLM's file: vllm/v1/spec_decode/ngram_proposer.py. It searches with KMP
in numba over a batch, and takes the *earliest* occurrence of the longest
match; this is a plain scan per sequence, O(length x n), and takes the
most recent one (the nearer context, as the issue that added it asks).

Left out: draft models, EAGLE and MTP heads (their proposals come from
another forward pass), suffix decoding.
"""
from __future__ import annotations


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int,
                 prompt_lookup_min: int):
        self.k = num_speculative_tokens
        self.max_n = prompt_lookup_max
        self.min_n = prompt_lookup_min

    def propose(self, token_ids: list[int], max_tokens: int | None = None,
                k: int | None = None) -> list[int]:
        """Up to `min(k, max_tokens)` draft tokens to follow `token_ids`
        (prompt + output so far), or [] when no n-gram matches. `k`: this
        step's number (default: the configured one)."""
        k = self.k if k is None else k
        k = k if max_tokens is None else min(k, max_tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            start = find_latest(token_ids, n)
            if start is not None:
                return copy_from(token_ids, start + n, k)
        return []


def copy_from(token_ids: list[int], follow: int, k: int) -> list[int]:
    """The k tokens from position `follow` on; past the end, the copy goes
    on with its own output (period len(token_ids) - follow)."""
    text = list(token_ids)
    for i in range(k):
        text.append(text[follow + i])  # follow + i < len(text): always defined
    return text[len(token_ids):]


def find_latest(token_ids: list[int], n: int) -> int | None:
    """Where the most recent earlier copy of the last `n` tokens starts
    (it may overlap them, as in "a a a a"), or None."""
    suffix = token_ids[-n:]
    first = suffix[0]
    for start in range(len(token_ids) - n - 1, -1, -1):
        if token_ids[start] == first and token_ids[start:start + n] == suffix:
            return start
    return None
