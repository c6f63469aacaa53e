"""What a request receives: RequestOutput and CompletionOutput, vLLM's shapes (ch03).

The engine's output processor (common/engine/output_processor.py) builds
one `RequestOutput` per request per step (`RequestOutputKind.DELTA`: this
step's tokens and text) or once, when it finishes (`FINAL_ONLY`: the whole
answer). Its `outputs` holds one `CompletionOutput`, as in vLLM with
`n=1`: the servers fan a request's `n` choices out into `n` engine
requests, and the offline `LLM` gives `n=1` (see below).

`FinishReason` is why a sequence stopped; its values are OpenAI's and
vLLM's strings ("stop", "length", "abort", "error"), so that it goes on the
wire and into Prometheus labels as it is.

Left out: vLLM's `n > 1` inside one RequestOutput, `cumulative_logprob`,
`stop_reason` (which stop string or token matched),
per-request metrics on the output (the engine records them itself:
common/metrics/stats.py).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from common.layers.sampler import SampledToken


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, or the context is full
    ABORT = "abort"  # the client went away (or the server aborted it)
    ERROR = "error"  # this request failed inside the engine; the others go on


@dataclass
class CompletionOutput:
    """One sequence's answer: this step's part (DELTA) or all of it (FINAL_ONLY)."""
    index: int
    text: str  # stop strings removed and never sent
    token_ids: list[int]
    logprobs: list[SampledToken]
    finish_reason: FinishReason | None = None  # None while it runs
    num_output_tokens: int = 0  # all of them so far, even in a delta (ours: for `usage`)
    error: str | None = None  # what went wrong, when finish_reason is ERROR (ours)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What one request receives at a step."""
    request_id: str
    prompt: str | None  # the prompt's text, where the caller gave text (the offline LLM)
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (ch04)
    # ch06: each prompt token's logprobs (the first None), in the request's
    # first output; only if its SamplingParams asked (prompt_logprobs)
    prompt_logprobs: list[SampledToken | None] | None = None
