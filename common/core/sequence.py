"""Sequence: one request's tokens and where its KV cache lives (ch03).

`num_computed_tokens` counts the tokens whose K and V are in the cache.
Prefill, a prefill chunk, a decode step and a recompute after preemption
are all the same move: feed the tokens from `num_computed_tokens` up to
`num_tokens`, then sample one more once they are all computed.

Who writes `num_computed_tokens`, one writer per event:

- admission: `BlockManager.allocate` sets it to the prefix found in the
  prefix cache (0 without prefix caching, ch04);
- after a step: `Scheduler.update_from_output` adds the tokens just fed;
- preemption or finish: `BlockManager.deallocate` sets it back to 0 (the
  K/V are gone; a preempted sequence recomputes them, ch05).

ch06: a request asking for `prompt_logprobs` collects them in
`prompt_logprobs` as its prompt is computed, chunk by chunk (the first
token has none: nothing predicts it). Such a request reads nothing from
the prefix cache (vLLM's rule): a cached block has no logits left.

ch07: a constrained request's grammar (`structured_output`, attached by
the engine's StructuredOutputManager) moves with every token appended.

Left out: beam groups (one sequence per request; `n > 1` sends n requests).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from common.layers.sampler import RequestSamplingState, SampledToken
from common.outputs import FinishReason
from common.sampling_params import SamplingParams


class TokenConstraint(Protocol):
    """What a sequence's grammar does with each token it appends (ch07:
    common/structured_output/manager.py's `StructuredOutputGrammar`, which
    needs xgrammar: this module never imports it)."""

    def accept_token(self, token_id: int) -> bool: ...


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a sequence is itself, not its contents: usable as a dict key
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[SampledToken] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)  # physical block ids
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache (see above)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    block_hashes: list[int] = field(default_factory=list)  # ch04: of each full block, once
    num_registered_blocks: int = 0  # ch04: blocks already in the prefix cache
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None  # what went wrong, when finish_reason is ERROR
    sampling: RequestSamplingState | None = None  # built by the engine (None: scheduler tests)
    structured_output: TokenConstraint | None = None  # ch07: its grammar, if any
    arrival_time: float = field(default_factory=time.monotonic)  # or the async front's
    first_scheduled_time: float | None = None  # set by the engine at its first step
    # ch06: the prompt tokens' logprobs so far (prompt_logprobs), the first one None
    prompt_logprobs: list[SampledToken | None] = field(default_factory=list)
    lora_int_id: int = 0  # ch10: the adapter it runs with (common/lora/), 0: none
    lora_name: str | None = None  # ch10: the adapter's name, for metrics and the live view

    def __post_init__(self) -> None:
        # Prompt + output in one list, appended once per token: the runner
        # slices it each step without rebuilding it.
        self.token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        self.stop_token_ids = frozenset(self.params.stop_token_ids)  # once, not a list per step
        if self.wants_prompt_logprobs and not self.prompt_logprobs:
            self.prompt_logprobs = [None]  # the first token: nothing predicts it

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        """ch06: of the positions fed this step, [start, end), those whose
        logits give a prompt logprob not yet collected: position p
        predicts prompt token p + 1. Empty unless the request asked, and
        after a preemption's recompute (collected already)."""
        if not self.wants_prompt_logprobs:
            return range(0)
        return range(max(start, len(self.prompt_logprobs) - 1),
                     min(end, self.num_prompt_tokens - 1))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append(self, sampled: SampledToken) -> None:
        self.token_ids.append(sampled.token_id)
        self.output_token_ids.append(sampled.token_id)
        self.output_logprobs.append(sampled)
        if self.sampling is not None:
            self.sampling.append(sampled.token_id)
        if self.structured_output is not None:  # ch07: the grammar moves on
            self.structured_output.accept_token(sampled.token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep only the first `num_output_tokens` output tokens: a stop
        string matched inside a step's run of tokens (ch07's accepted
        drafts). The sequence is finishing, so its sampling state and
        grammar are not rolled back."""
        del self.output_token_ids[num_output_tokens:]
        del self.output_logprobs[num_output_tokens:]
        del self.token_ids[self.num_prompt_tokens + num_output_tokens:]

    def check_stop(self, eos_token_ids: set[int], max_model_len: int) -> FinishReason | None:
        """Finish reason after the last appended token, or None to go on.
        (Stop *strings* are checked on the text, by the output processor.)"""
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= self.params.min_tokens:
            if last in self.stop_token_ids:
                return FinishReason.STOP
            if not self.params.ignore_eos and last in eos_token_ids:
                return FinishReason.STOP
        if self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None
