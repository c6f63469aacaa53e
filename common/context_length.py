"""The context rule, every chapter's (ch01): a prompt and its answer fit in max_model_len.

`check_context_length` raises `ContextLengthError` (the servers answer
400 `context_length_exceeded`, as OpenAI does); `default_max_tokens` is
what a request that gives no `max_tokens` gets. Chapters 01-02 apply it
alone; from chapter 03 the engine's admission (common/engine/admission.py)
adds the KV cache's size.

Left out: vLLM's shortening of `max_tokens` to fit (a 400 here).
"""
from __future__ import annotations

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
