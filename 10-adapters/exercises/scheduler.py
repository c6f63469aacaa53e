"""Exercise 10b: at most `--max-loras` adapters in one step.

An adapter can only run from a slot: its A and B copied into the
stacked tensors every LoRA layer reads (common/lora/layers.py), and there
are `max_loras` slots. Before each forward pass the engine gives the
step's adapters a slot each (common/lora/model_manager.py's
`set_active_adapters`), and refuses a step with more adapters than
slots. The scheduler must never build one: chapter 05's
`ContinuousScheduler` with one more question at admission, as vLLM's
scheduler asks it, "would this request bring one adapter too many into
the step?"

    running: base, pirate, pirate, shout        max_loras = 2
    waiting: pirate -> admitted  (pirate has a slot already)
             base   -> admitted  (the base model takes no slot)
             french -> waits     (both slots are taken)

You write the two methods that answer it:

1. `running_loras`: the adapters that hold a slot in this step;
2. `over_lora_budget`: whether a waiting request would need one more
   slot than there are.

Given: the constructor, `may_admit` (which asks `over_lora_budget` before
chapter 05's question about blocks) and `_admit`, which goes on past a
request that only the adapter budget holds back (it keeps its place at
the front of the queue, and the requests behind it whose adapters fit
go ahead, as in vLLM). Every sequence carries `seq.lora_int_id`: its
adapter's id, at least 1, or 0 for the base model (common/core/sequence.py).

Graded by `make exercise CH=10b` (the tests marked `ex10b` in
tests/test_ch10_lora_budget_exercise.py: your methods on sequences set
by hand, then your scheduler stepped with fake model outputs until every
request is done, then in the engine with two seeded random adapters and
one slot). exercises/README-10b.md has the tasks and the hints; a
failing test names the hint to read first. Once every test passes,
compare with common/lora/scheduler.py.

Left out, as in the course's scheduler: preemption that knows adapters
(vLLM's), priorities between adapters, a limit on how long a request may
be held back.
"""
from __future__ import annotations

from common.core.scheduler import ContinuousScheduler, ScheduledSeq
from common.core.sequence import Sequence


class LoRAScheduler(ContinuousScheduler):
    def __init__(self, *args, max_loras: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_loras = max_loras

    def running_loras(self) -> set[int]:
        """The ids of the adapters that the running sequences use.

        `self.running`: the sequences of this step, those admitted earlier
        in this very step included (`_admit` appends each one as it goes).
        returns: a set of lora_int_id, e.g. {1, 3} for running sequences of
                 ids 0, 1, 1 and 3 (0 is the base model: not an adapter).
        """
        # Stuck? exercises/README-10b.md, hint 1.
        raise NotImplementedError("running_loras: the running sequences' adapters, "
                                  "the base model left out")

    def over_lora_budget(self, seq: Sequence) -> bool:
        """Would admitting `seq`, a waiting sequence, put one adapter more
        into the step than there are slots (`self.max_loras`)?

        True only when `seq` needs a slot that no running sequence has
        given its adapter yet, and every slot is already taken.
        """
        # Stuck? exercises/README-10b.md, hints 2 and 3.
        raise NotImplementedError("over_lora_budget: does seq need a new slot, "
                                  "and are all max_loras of them taken?")

    # ---------------------------------------------------------- given
    def may_admit(self, seq: Sequence) -> bool:
        return not self.over_lora_budget(seq) and super().may_admit(seq)  # ch10

    def _admit(self, budget: int) -> list[ScheduledSeq]:
        """Chapter 05's admission, going on past a request that only the
        adapter budget holds back; it keeps its place at the front."""
        admitted: list[ScheduledSeq] = []
        held_back: list[Sequence] = []
        while True:
            admitted += super()._admit(budget - sum(item.num_new_tokens for item in admitted))
            if not (self.waiting and self.over_lora_budget(self.waiting[0])):
                break
            held_back.append(self.waiting.popleft())
        self.waiting.extendleft(reversed(held_back))
        return admitted
