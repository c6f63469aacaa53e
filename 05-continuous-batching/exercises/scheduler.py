"""Exercise 05: the continuous scheduler (iteration-level scheduling).

You write the class that decides, at *every* step, who runs in the next
forward pass and how many tokens each feeds, then takes in what the model
sampled:

- running sequences first, oldest first: one decode token each, or the
  next chunk of a prompt that did not fit the token budget (chunked
  prefill); a sequence whose last block is full needs a new one, and
  when none is free the *newest* running sequence is preempted;
- then waiting sequences join, first come first served, while
  `max_num_seqs`, the token budget `max_num_batched_tokens` and the free
  blocks allow;
- after the step, every scheduled sequence moves its `num_computed_tokens`
  forward, takes its sampled token and finishes on EOS, a stop token id,
  its `max_tokens` or the context length.

Preemption is by recompute (vLLM v1): the victim's blocks are freed, it
goes back to the *front* of `waiting`, keeps its output tokens, and its
prompt + outputs so far are prefilled again when it is readmitted.

The engine builds it as `ContinuousScheduler(block_manager, max_num_seqs,
max_num_batched_tokens, eos_token_ids, max_model_len,
long_prefill_token_threshold=...)` and calls `add`,
`has_unfinished`, `schedule`, `update_from_output`, `finish`; it reads
`running`, `waiting`, `num_preemptions` and `max_num_seqs`.

Graded by `make exercise CH=05`: the tests marked `ex05` in
tests/test_scheduler_unit.py and tests/test_scheduler_invariants.py (the
scheduler alone, fake model outputs, seconds) and
tests/test_ch05_scheduler.py (the real engine: your scheduler must give
HF's greedy tokens). exercises/README.md has the tasks in order and the
hints; a failing test names the hint to read first. Once every test
passes, compare your class with `Scheduler` + `ContinuousScheduler` in
common/core/scheduler.py, the one the servers run.

Given: the constructor, `add`, `has_unfinished`, `finish`. Left out, as in
the course's scheduler: priorities, swapping preempted blocks to CPU
memory, a watermark of spare blocks, fairness between clients.

Left out on purpose, although the course's scheduler has them: the
static policy of chapters 03-04 (`StaticScheduler`: the course writes the
step once, in `Scheduler`, and each policy only decides `make_room` and
`may_admit`; here you write one policy whole, so the step is yours too),
and the hooks chapter 07's `SpeculativeScheduler` overrides to book
draft tokens and roll back the rejected ones (`schedule_running`,
`append_sampled`). Speculative decoding comes in chapter 07, which runs
the course's scheduler; the tests that grade this exercise give one
token per step.
"""
from __future__ import annotations

from collections import deque

from common.core.block_manager import BlockManager
from common.core.scheduler import ScheduledSeq  # (seq, num_new_tokens); .samples
from common.core.sequence import Sequence, SequenceStatus
from common.layers.sampler import SampledToken, SamplingFailed


class ContinuousScheduler:
    """Join and leave at every step; preempt the newest when out of blocks."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, eos_token_ids: set[int] = frozenset(),
                 max_model_len: int = 8192, long_prefill_token_threshold: int = 0):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs  # sequences in one step, at most
        self.max_num_batched_tokens = max_num_batched_tokens  # tokens in one step, at most
        # Prompt tokens one sequence feeds in one step, at most (0: no cap),
        # so that a long prompt leaves room for newcomers.
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()  # first come, first served
        self.running: list[Sequence] = []  # in admission order: running[-1] is the newest
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------- the step
    def schedule(self) -> list[ScheduledSeq]:
        """The batch of the next step: running sequences first, then newcomers.

        Returns one `ScheduledSeq(seq, num_new_tokens)` per sequence that
        runs: `num_new_tokens` is 1 for a decode, more for a prompt (or a
        chunk of it, or the recompute of a preempted sequence). Each feeds
        the tokens from `seq.num_computed_tokens` on. Never more than
        `max_num_seqs` sequences running or `max_num_batched_tokens`
        tokens in one batch.
        """
        # 1. The running sequences, oldest first, while the token budget
        #    lasts; a decode needs a slot for its newest token (self.bm), and
        #    when there is none, a running sequence is preempted.
        # 2. Then waiting sequences join, first come first served.
        # Stuck? exercises/README.md, hints 1 and 3 to 5.
        raise NotImplementedError("schedule: running first (make room, preempt the newest), "
                                  "then admit waiting sequences; return the ScheduledSeqs")

    def preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: free seq's blocks and put it back at the
        front of `waiting`, status WAITING. Counts it (`num_preemptions`,
        and `seq.num_preemptions`). Its output tokens are kept."""
        # self.bm.deallocate(seq) empties the block table and sets
        # num_computed_tokens back to 0 (its K/V are gone). Stuck?
        # exercises/README.md, hint 6.
        raise NotImplementedError("preempt: out of running, blocks freed, front of waiting")

    # ------------------------------------------------------- after a step
    def update_from_output(self, batch: list[ScheduledSeq],
                           sampled: dict[Sequence, list[SampledToken] | SamplingFailed]
                           ) -> list[Sequence]:
        """Take in what the model computed and sampled for `batch`.

        `sampled` maps each sequence that sampled (its last prompt chunk
        or a decode) to its new tokens, a list of `SampledToken` (one
        here; chapter 07's speculative decoding gives several), or to
        `SamplingFailed` when sampling that row raised. Returns the sequences that got a new
        token or failed (finished ones included), not the prefill chunks
        that did not sample.
        """
        # Stuck? exercises/README.md, hints 1 and 2.
        raise NotImplementedError("update_from_output: advance num_computed_tokens, append, "
                                  "finish on stop/length/error")

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Free a finished, failed or aborted sequence's blocks at once.
        (The engine also calls it: aborts, stop strings.)"""
        if seq in self.running:
            self.running.remove(seq)
            self.bm.deallocate(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
