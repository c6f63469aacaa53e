"""The scheduler: which sequences run in the next forward pass (ch05).

Two policies over the same queues (`waiting`, first come first served, and
`running`):

- `static` (chapters 03 and 04): a batch is admitted only when the previous
  one has finished, and only as many sequences as the cache can hold at
  their worst case (prompt + max_tokens). New arrivals wait for the whole
  batch. Chapter 03 runs batches of one sequence.
- `continuous` (chapter 05, Orca/vLLM): at *every* step, running sequences
  go first (one decode token each, or the next chunk of their prompt), then
  waiting sequences join while `max_num_seqs`, `max_num_batched_tokens` and
  free blocks allow. Prefill chunks and decode tokens share one flat batch.
  When a running sequence needs a block and none is free, the newest running
  sequence is preempted: its blocks are freed, it goes back to the front of
  `waiting` and its tokens (prompt + output so far) are recomputed later.

Chunked prefill: a prompt longer than the step's token budget is fed over
several steps; it only samples once its last chunk is in.

Left out: priorities, swapping preempted blocks to CPU memory, a
watermark of spare blocks, fairness between clients.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from common.engine.block_manager import BlockManager
from common.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens fed this step: 1 for decode, more for prefill

    @property
    def samples(self) -> bool:
        """Does this step reach the end of the sequence (so we sample)?"""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, policy: str = "continuous",
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512):
        assert policy in ("static", "continuous")
        self.bm = block_manager
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------- the step
    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preemptions_before = self.num_preemptions
        for seq in list(self.running):  # oldest first
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted a moment ago to make room for an older one
            if not self._make_room(seq):
                continue  # seq itself was the newest: preempted
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        if self.num_preemptions == preemptions_before:  # no admission under pressure
            scheduled += self._admit(budget)
        return scheduled

    def _make_room(self, seq: Sequence) -> bool:
        """A slot for seq's next token, preempting newer sequences if needed.
        False if seq itself had to be preempted."""
        while not self.bm.can_append(seq):
            if self.policy == "static":
                raise RuntimeError("static batch ran out of blocks (admission bug)")
            victim = self.running[-1]  # the newest
            self.preempt(victim)
            if victim is seq:
                return False
        self.bm.may_append(seq)
        return True

    def _admit(self, budget: int) -> list[ScheduledSeq]:
        if self.policy == "static" and self.running:
            return []  # static batching: wait for the whole batch to finish
        admitted: list[ScheduledSeq] = []
        free_at_start, worst_case_blocks = self.bm.num_free_blocks, 0
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.policy == "static":
                need = self.bm.blocks_needed(self._worst_case_tokens(seq))
                if worst_case_blocks + need > free_at_start:
                    break
                worst_case_blocks += need
            if not self.bm.can_allocate(seq):
                break
            self.waiting.popleft()
            self.bm.allocate(seq)  # sets num_computed_tokens to the cached prefix
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            admitted.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return admitted

    def _worst_case_tokens(self, seq: Sequence) -> int:
        return seq.num_prompt_tokens + seq.params.max_tokens

    def preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop its KV, requeue it at the front."""
        self.running.remove(seq)
        self.bm.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------- after a step
    def finish(self, seq: Sequence, reason: str) -> None:
        """Free a finished or aborted sequence's blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
            self.bm.deallocate(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
