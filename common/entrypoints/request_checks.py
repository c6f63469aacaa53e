"""The checks every chapter's server makes on a request before any engine (ch01).

The model's name (404, as OpenAI answers for another model), the context
rule (a 400 naming the prompt's field: common/engine/admission.py's rule,
the engine's own), and the usage block of an answer. Chapters 01-02 call
them directly; chapter 03's serving layer (serving_engine.py) on top.

Left out: everything that needs the engine (its admission by blocks,
its errors): serving_engine.py.
"""
from __future__ import annotations

from common.context_length import ContextLengthError, check_context_length
from common.entrypoints.middleware import APIError
from common.entrypoints.responses import PromptTokensDetails, Usage


def check_model_name(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(404, f"The model `{requested}` does not exist.",
                       "not_found_error", "model", "model_not_found")


def context_error(exc: ContextLengthError, param: str) -> APIError:
    return APIError(400, str(exc), param=param, code="context_length_exceeded")


def check_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int,
                  param: str) -> None:
    """The engine's context rule, as a 400 naming the prompt's field (ch01-02)."""
    try:
        check_context_length(num_prompt_tokens, max_tokens, max_model_len)
    except ContextLengthError as exc:
        raise context_error(exc, param) from None


def usage(prompts: list[list[int]], completion_tokens: int,
          details: PromptTokensDetails | None = None) -> Usage:
    """`details`: the prefix cache's part in the prompts, told only with
    --enable-prompt-tokens-details (ch06)."""
    prompt_tokens = sum(len(p) for p in prompts)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)
