"""The scheduler (ch03-05): which sequences run in the next forward pass,
and what changes once it has run.

Both policies share the queues (`waiting`, first come first served, and
`running`), the step and its update; they differ in two decisions, which
each subclass makes:

- `StaticScheduler` (chapters 03 and 04): a batch is admitted only when the
  previous one has finished, and only as many sequences as the cache can
  hold at their worst case (prompt + max_tokens), so it never runs out of
  blocks. New arrivals wait for the whole batch. Chapter 03 runs batches
  of one sequence.
- `ContinuousScheduler` (chapter 05, Orca/vLLM): at *every* step, running
  sequences go first (one decode token each, or the next chunk of their
  prompt), then waiting sequences join while `max_num_seqs`,
  `max_num_batched_tokens` and free blocks allow. Prefill chunks and decode
  tokens share one flat batch. When a running sequence needs a block and
  none is free, the newest running sequence is preempted: its blocks are
  freed, it goes back to the front of `waiting` and its tokens (prompt +
  output so far) are recomputed later.

Chunked prefill: a prompt longer than the step's token budget is fed over
several steps; it only samples once its last chunk is in. A long prompt
feeds at most `long_prefill_token_threshold` tokens per step (vLLM's
`--long-prefill-token-threshold`), so it cannot take a whole step's budget
while newcomers wait: their first token comes after one step, not after
the long prompt's whole prefill.

After the model has run, `update_from_output` advances each sequence's
`num_computed_tokens`, appends the sampled tokens, finishes the sequences
that hit EOS, a stop token id or their length, and frees their blocks.
(Stop *strings* need the text: the output processor finds them, and the
engine then calls `finish`.)

Chapter 07 swaps in `SpeculativeScheduler` (common/spec_decode/speculative.py),
a subclass that books draft tokens into the step and rolls back the rejected
ones: nothing here knows about drafts. The hooks it overrides are
`schedule_running` (what a running sequence feeds this step) and
`append_sampled` (what its new tokens do to it).

Left out: priorities, swapping preempted blocks to CPU memory, a
watermark of spare blocks, fairness between clients beyond the prefill cap
(vLLM's `--max-num-partial-prefills`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from common.core.block_manager import BlockManager
from common.core.sequence import Sequence, SequenceStatus
from common.layers.sampler import SampledToken, SamplingFailed
from common.outputs import FinishReason


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens fed this step: 1 for decode, more for prefill

    @property
    def samples(self) -> bool:
        """Does this step reach the end of the sequence (so we sample)?"""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens

    @property
    def num_logits_rows(self) -> int:
        """Rows of this sequence that go through the LM head: its last
        token's if it samples, else none."""
        return 1 if self.samples else 0

    def input_token_ids(self) -> list[int]:
        """The tokens fed this step: from `num_computed_tokens` on."""
        start = self.seq.num_computed_tokens
        return self.seq.token_ids[start:start + self.num_new_tokens]


class Scheduler:
    """The queues, the step and its update; subclasses choose the policy."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, eos_token_ids: set[int] = frozenset(),
                 max_model_len: int = 8192, long_prefill_token_threshold: int = 0):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold  # 0: no cap
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
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
            item = self.schedule_running(seq, budget)
            if item is None:
                continue  # seq itself was the newest: preempted
            scheduled.append(item)
            budget -= item.num_new_tokens
        if self.num_preemptions == preemptions_before:  # ch05: no admission under pressure
            scheduled += self._admit(budget)
        return scheduled

    def num_new_tokens(self, seq: Sequence, budget: int) -> int:
        """The tokens `seq` feeds this step: what it has not computed yet,
        within the step's budget and the cap on a long prompt's chunk."""
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)  # ch05: chunks
        if 0 < self.long_prefill_token_threshold < num_new:  # ch05: room for newcomers
            num_new = self.long_prefill_token_threshold
        return num_new

    def schedule_running(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        """A running sequence's part of the step: room for its next token,
        then its tokens. None if it was preempted to make that room."""
        if not self.make_room(seq):
            return None
        return ScheduledSeq(seq, self.num_new_tokens(seq, budget))

    def make_room(self, seq: Sequence) -> bool:
        """A slot for seq's next token. False if seq could not get one."""
        raise NotImplementedError

    def start_admission(self) -> bool:
        """May waiting sequences join at this step at all?"""
        return True

    def may_admit(self, seq: Sequence) -> bool:
        """Can `seq`, the head of the queue, join the running batch now?
        (Called with the sequence slots and the token budget already checked.)"""
        raise NotImplementedError

    def _admit(self, budget: int) -> list[ScheduledSeq]:
        admitted: list[ScheduledSeq] = []
        if not self.start_admission():
            return admitted
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.may_admit(seq):
                break
            self.waiting.popleft()
            self.bm.allocate(seq)  # sets num_computed_tokens to the cached prefix
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_new = self.num_new_tokens(seq, budget)
            admitted.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return admitted

    def preempt(self, seq: Sequence) -> None:  # ch05: preemption by recompute
        """Recompute-style preemption: drop its KV, requeue it at the front."""
        self.running.remove(seq)
        self.bm.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------- after a step
    def update_from_output(self, batch: list[ScheduledSeq],
                           sampled: dict[Sequence, list[SampledToken] | SamplingFailed]
                           ) -> list[Sequence]:
        """Take in what the model computed and sampled: for each sequence
        that sampled, its new tokens (a list of one token; chapter 07's
        speculation gives more) or `SamplingFailed`. Returns the sequences
        that got new tokens (or failed), finished ones included."""
        updated = []
        for item in batch:
            seq, tokens = item.seq, sampled.get(item.seq)
            if tokens is None:  # a prefill chunk that is not the last
                seq.num_computed_tokens += item.num_new_tokens  # writer: after a step
                self.bm.cache_full_blocks(seq)  # ch04: blocks that just filled
                continue
            if isinstance(tokens, SamplingFailed):
                self.finish(seq, FinishReason.ERROR, f"sampling failed: {tokens.error!r}")
            else:
                self.append_sampled(item, tokens)
            updated.append(seq)
        return updated

    def append_sampled(self, item: ScheduledSeq, tokens: list[SampledToken]) -> None:
        """The step computed `item`'s tokens and sampled `tokens`: append
        them, then finish the sequence or let it go on."""
        seq = item.seq
        seq.num_computed_tokens += item.num_new_tokens  # writer: after a step
        reason = self.append_tokens(seq, tokens)
        self.bm.cache_full_blocks(seq)  # ch04: blocks that just filled
        if reason is not None:
            self.finish(seq, reason)

    def append_tokens(self, seq: Sequence, tokens: list[SampledToken]) -> FinishReason | None:
        """Append one by one, each checked for a stop (EOS, a stop token id,
        the length): a stop ends the run there. Returns its reason, or None."""
        for token in tokens:
            seq.append(token)
            reason = seq.check_stop(self.eos_token_ids, self.max_model_len)
            if reason is not None:
                return reason
        return None

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Free a finished, failed or aborted sequence's blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
            self.bm.deallocate(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error


class StaticScheduler(Scheduler):  # ch03-04: static batching
    """ch03-04: whole batches, each reserved at its worst case."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.long_prefill_token_threshold = 0  # no cap: newcomers wait for the batch anyway

    def start_admission(self) -> bool:
        self._free_at_start, self._reserved = self.bm.num_free_blocks, 0
        return not self.running  # static batching: wait for the whole batch to finish

    def may_admit(self, seq: Sequence) -> bool:
        worst_case = self.bm.blocks_needed(seq.num_prompt_tokens + seq.params.max_tokens)
        if self._reserved + worst_case > self._free_at_start:
            return False
        self._reserved += worst_case
        return True

    def make_room(self, seq: Sequence) -> bool:
        if not self.bm.can_append(seq):  # the worst case was reserved at admission
            raise RuntimeError("static batch ran out of blocks (admission bug)")
        self.bm.may_append(seq)
        return True


class ContinuousScheduler(Scheduler):  # ch05: iteration-level scheduling
    """ch05: join and leave at every step; preempt the newest when out of blocks."""

    def make_room(self, seq: Sequence) -> bool:
        while not self.bm.can_append(seq):
            victim = self.running[-1]  # ch05: preempt the newest
            self.preempt(victim)
            if victim is seq:
                return False
        self.bm.may_append(seq)
        return True

    def may_admit(self, seq: Sequence) -> bool:
        return self.bm.can_allocate(seq)  # ch05: whenever blocks allow
