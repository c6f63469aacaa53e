"""Speculative decoding in the engine (ch07, `--speculative-config`): the
scheduler that books draft tokens, and the sampling step that checks them.

Chapter 05's `ContinuousScheduler` feeds a decoding sequence one token a
step. `SpeculativeScheduler` (a subclass: chapter 05's file has no draft
code) feeds its last token and k guessed tokens after it, as one short
prefill chunk over the cached context:

    step n:    schedule_running   books 1 + k tokens and their slots
               model runner       k + 1 rows of logits (SpecScheduledSeq)
               SpeculativeSampling  RejectionSampler keeps the drafts the
                                  model agrees with, plus one token
               append_sampled     accepted tokens appended; the rejected
                                  drafts' K/V and blocks rolled back
               propose_drafts     NgramProposer guesses step n+1's drafts

Drafts only take what is left: they are cut to the step's token budget,
and dropped (the sequence decodes one token) when their slots would need a
preemption. Only blocks of accepted tokens are ever hashed for the prefix
cache. The drafts checked and accepted are counted by the engine's
`StatsCollector` (common/metrics/stats.py), from the batch and the sampled
tokens, as vLLM's `SpecDecodingStats` (published as `vllm:spec_decode_*`).

vLLM's files: vllm/v1/core/sched/scheduler.py (drafts in the scheduler's
token budget, `num_lookahead_tokens`), vllm/v1/spec_decode/ngram_proposer.py,
vllm/v1/sample/rejection_sampler.py.

Left out: draft models, EAGLE and MTP heads, tree attention over several
drafts, proposing for step n+1 while step n runs (vLLM's async scheduling).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cache
from typing import TypeVar

import torch

from common.config import ConfigError, SpeculativeConfig
from common.core.scheduler import ContinuousScheduler, ScheduledSeq
from common.core.sequence import Sequence
from common.layers.rejection_sampler import RejectionSampler
from common.layers.sampler import SampledToken
from common.outputs import FinishReason
from common.spec_decode.ngram_proposer import NgramProposer
from common.worker.model_runner import PlainSampling, SampledTokens


@dataclass
class SpecScheduledSeq(ScheduledSeq):
    """A decoding sequence checking drafts: its last token, then the drafts
    (`num_new_tokens` = 1 + k), with k + 1 rows through the LM head."""
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        return True  # it feeds its last token: it always samples

    @property
    def num_logits_rows(self) -> int:
        return 1 + len(self.draft_token_ids)

    def input_token_ids(self) -> list[int]:
        return self.seq.token_ids[self.seq.num_computed_tokens:] + self.draft_token_ids


class DraftScheduling:
    """ch07: n-gram drafts checked every step, on top of a continuous
    scheduler (a mixin: `SpeculativeScheduler` is it on chapter 05's, and
    `with_drafts` puts it on any subclass of chapter 05's a learner hands in)."""

    def __init__(self, *args, speculative_config: SpeculativeConfig, **kwargs):
        super().__init__(*args, **kwargs)
        self.speculative_config = speculative_config
        self.proposer = NgramProposer(speculative_config.num_speculative_tokens,
                                      speculative_config.prompt_lookup_max,
                                      speculative_config.prompt_lookup_min)
        self.drafts: dict[Sequence, list[int]] = {}  # each decoding sequence's next drafts

    # ----------------------------------------------------------- the step
    def schedule_running(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        drafts = self.schedulable_drafts(seq, budget)
        if not drafts:
            return super().schedule_running(seq, budget)  # one token, as chapter 05
        self.bm.may_append(seq, len(drafts))  # slots for the last token + the drafts
        return SpecScheduledSeq(seq, 1 + len(drafts), drafts)

    def schedulable_drafts(self, seq: Sequence, budget: int) -> list[int]:
        """The drafts `seq` checks this step: only when it decodes (its one
        uncomputed token is the last one), within the budget, and only if
        their slots are free without preempting anyone."""
        drafts = self.drafts.get(seq)
        if not drafts or seq.num_computed_tokens != seq.num_tokens - 1:
            return []
        drafts = drafts[:budget - 1]
        return drafts if drafts and self.bm.can_append(seq, len(drafts)) else []

    def preempt(self, seq: Sequence) -> None:
        super().preempt(seq)
        self.drafts.pop(seq, None)  # proposed again once it decodes

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        super().finish(seq, reason, error)
        self.drafts.pop(seq, None)

    # ------------------------------------------------------- after a step
    def update_from_output(self, batch: list[ScheduledSeq], sampled: SampledTokens
                           ) -> list[Sequence]:
        updated = super().update_from_output(batch, sampled)
        self.propose_drafts()
        return updated

    def append_sampled(self, item: ScheduledSeq, tokens: list[SampledToken]) -> None:
        """`tokens`: the accepted drafts and one more. Only the accepted
        drafts count as computed (not the rejected ones, nor any accepted
        past a stop); blocks that only rejected drafts used go back."""
        if not isinstance(item, SpecScheduledSeq):
            return super().append_sampled(item, tokens)
        seq = item.seq
        reason = self.append_tokens(seq, tokens)
        seq.num_computed_tokens = seq.num_tokens - 1  # writer: after a step (all but the newest)
        self.bm.cache_full_blocks(seq)  # only blocks of accepted tokens
        if reason is not None:
            self.finish(seq, reason)
        else:
            self.bm.free_blocks_past_end(seq)  # the rejected drafts' blocks

    def propose_drafts(self) -> None:
        """Drafts for every sequence that decodes next step: as many as the
        batch size's schedule allows, never more than its answer has room
        for (the step may also add a bonus token)."""
        k = self.speculative_config.num_speculative_tokens_for(len(self.running))
        for seq in self.running:
            if seq.num_computed_tokens != seq.num_tokens - 1 or k == 0:
                self.drafts.pop(seq, None)  # still prefilling, or no drafts at this size
                continue
            room = min(seq.params.max_tokens - seq.num_output_tokens,
                       self.max_model_len - seq.num_tokens) - 1
            self.drafts[seq] = self.proposer.propose(seq.token_ids, room, k)


class SpeculativeSampling(PlainSampling):
    """ch07: the model runner's sampling step when sequences check drafts.
    Rows without drafts go through chapter 03's sampler in one call, as
    without speculation (`PlainSampling`); each speculating sequence's
    k + 1 rows go through the `RejectionSampler`, all in one call."""

    def __init__(self):
        super().__init__()
        self.rejection_sampler = RejectionSampler()

    def __call__(self, logits: torch.Tensor, sampling: list[ScheduledSeq],
                 rows: list[range]) -> SampledTokens:
        """logits: (sum of rows, vocab); `rows[i]`: sampling[i]'s rows."""
        plain = [(item, r) for item, r in zip(sampling, rows)
                 if not isinstance(item, SpecScheduledSeq)]
        speculating = [(item, r) for item, r in zip(sampling, rows)
                       if isinstance(item, SpecScheduledSeq)]
        results: SampledTokens = {}
        if plain:
            plain_logits = logits if not speculating else logits[[r[0] for _, r in plain]]
            results.update(super().__call__(plain_logits, [item for item, _ in plain]))
        if speculating:  # every draft row, in one call
            verified = self.rejection_sampler(
                logits[[row for _, r in speculating for row in r]],
                [item.seq.sampling for item, _ in speculating],
                [item.draft_token_ids for item, _ in speculating])
            results.update(zip((item.seq for item, _ in speculating), verified))
        return results


class SpeculativeScheduler(DraftScheduling, ContinuousScheduler):
    """ch07: chapter 05's scheduler, with n-gram drafts checked every step."""


@dataclass(frozen=True)
class DraftingSchedulerFactory:
    """Builds `scheduler_cls` with drafts, as `EngineParts.scheduler_cls`:
    a value that pickles (chapter 09's engine processes build their own),
    where a class made on the fly would not."""
    scheduler_cls: type
    speculative_config: SpeculativeConfig

    def __call__(self, *args, **kwargs) -> ContinuousScheduler:
        return drafting_class(self.scheduler_cls)(
            *args, speculative_config=self.speculative_config, **kwargs)


@cache
def drafting_class(scheduler_cls: type) -> type:
    """`scheduler_cls` with `DraftScheduling` in front of it (itself if it
    has it already; chapter 05's gives `SpeculativeScheduler`)."""
    if issubclass(scheduler_cls, DraftScheduling):
        return scheduler_cls
    if scheduler_cls is ContinuousScheduler:
        return SpeculativeScheduler
    return type(f"Speculative{scheduler_cls.__name__}", (DraftScheduling, scheduler_cls),
                {"__doc__": f"{scheduler_cls.__name__} with n-gram drafts (ch07)."})


Parts = TypeVar("Parts")  # common/engine/parts.py's EngineParts (a layer up: not imported)


def with_drafts(parts: Parts, speculative_config: SpeculativeConfig) -> Parts:
    """What `--speculative-config` swaps into a chapter's `EngineParts`: its
    scheduler (whichever subclass of chapter 05's it is) with drafts, and
    the model runner's sampling step that checks them."""
    if not issubclass(parts.scheduler_cls, ContinuousScheduler):
        raise ConfigError("--speculative-config needs continuous batching (chapter 05 on): "
                          "a static batch reserves no room for draft tokens.")
    return replace(parts, scheduler_cls=DraftingSchedulerFactory(parts.scheduler_cls,
                                                                 speculative_config),
                   sampling_cls=SpeculativeSampling)
