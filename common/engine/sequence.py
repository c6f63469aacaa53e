"""Sequence: one request's tokens and where its KV cache lives (ch03).

A sequence's `num_computed_tokens` counts the tokens whose K and V are in
the cache. Prefill, a prefill chunk, a decode step and a recompute after
preemption are all the same move: feed the tokens from `num_computed_tokens`
up to `num_tokens`, then sample one more once they are all computed.

Left out: beam groups (one sequence per request; `n > 1` sends n requests).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from common.layers.sampler import SampledToken
from common.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[SampledToken] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)  # physical block ids
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append(self, sampled: SampledToken) -> None:
        self.output_token_ids.append(sampled.token_id)
        self.output_logprobs.append(sampled)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def check_stop(self, eos_token_ids: set[int], max_model_len: int) -> str | None:
        """Finish reason after the last appended token, or None to go on.
        (Stop *strings* are checked on the text, by the engine.)"""
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= self.params.min_tokens:
            if last in self.params.stop_token_ids:
                return "stop"
            if not self.params.ignore_eos and last in eos_token_ids:
                return "stop"
        if self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None
