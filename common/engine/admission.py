"""What the engine admits (ch03): the context rule (common/context_length.py) and the cache's size.

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

from common.context_length import DEFAULT_MAX_TOKENS, check_context_length, default_max_tokens
from common.sampling_params import SamplingParams


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
