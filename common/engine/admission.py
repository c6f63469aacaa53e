"""What the engine admits (ch03): the context rule and the cache's size.

`Admission` holds the engine's sizes only (max_model_len, the blocks), so
a front in another process (chapter 09's `AsyncMPClient`) checks a
request without asking the engine; the engine checks with the same rules.
The entrypoints call `check` once per request, before `add_request`: the
engine trusts what it is given.

Left out: vLLM's shortening of `max_tokens` to fit (a prompt too long is
a 400 here, as in OpenAI's API).
"""
from __future__ import annotations

from dataclasses import dataclass

from common.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 256  # when a request gives none (chapter 06 fills the context)


class ContextLengthError(ValueError):
    """The prompt plus the completion do not fit in `max_model_len`."""


def check_context_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """The context rule, for every chapter (01-02 have no engine)."""
    total = num_prompt_tokens + max_tokens
    if num_prompt_tokens >= max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"your prompt has {num_prompt_tokens} tokens, which leaves no room for a "
            "completion. Please reduce the length of the prompt.")
    if total > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"you requested {total} tokens ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the length of the prompt "
            "or of the completion.")


def default_max_tokens(num_prompt_tokens: int, room: int,
                       cap: int | None = DEFAULT_MAX_TOKENS) -> int:
    """max_tokens for a request that gives none, when `room` tokens fit in
    all: what is left, at most `cap` (None: no cap, vLLM's rule, chapter
    06). At least 1, so that a prompt too long fails the context check."""
    left = room - num_prompt_tokens
    return max(1, left if cap is None else min(cap, left))


@dataclass(frozen=True)
class Admission:
    """The engine's admission rules, from its sizes alone: what a front in
    another process (chapter 09) checks without asking the engine."""
    max_model_len: int
    num_blocks: int
    block_size: int

    def check(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse at once what could never run (instead of hanging)."""
        if num_prompt_tokens == 0:
            raise ValueError("The decoder prompt cannot be empty")  # vLLM's words
        check_context_length(num_prompt_tokens, params.max_tokens, self.max_model_len)
        needed = -(-(num_prompt_tokens + params.max_tokens) // self.block_size)  # ceil
        if needed > self.num_blocks:
            raise ValueError(
                f"The request needs up to {needed} KV blocks but the cache only has "
                f"{self.num_blocks}: it can never fit on this card.")

    def default_max_tokens(self, num_prompt_tokens: int,
                           cap: int | None = DEFAULT_MAX_TOKENS) -> int:
        """What fits in the context and in the whole cache, at most `cap`."""
        return default_max_tokens(num_prompt_tokens,
                                  min(self.max_model_len, self.num_blocks * self.block_size), cap)
