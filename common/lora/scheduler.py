"""The scheduler with adapter slots (ch10): at most `--max-loras` adapters in a step.

Only adapters that have a slot can run (common/lora/model_manager.py), and
there are `max_loras` slots: a step may mix the base model and at most
that many distinct adapters. Chapter 05's `ContinuousScheduler` with one
more check at admission, as vLLM's scheduler makes it: a waiting request
whose adapter is not among the running ones' while they already use
`max_loras` waits, and the requests behind it go ahead (vLLM skips it; it
keeps its place at the front of the queue).

The trade-off `--max-loras` sets: each slot holds every adapted
projection's A and B on the card whether it is used or not, and the
products of every step read every slot (common/lora/punica.py's stacked
form); fewer slots, and requests for other adapters wait.

Left out: vLLM's LoRA-aware preemption, priorities between adapters.
"""
from __future__ import annotations

from common.core.scheduler import ContinuousScheduler, ScheduledSeq
from common.core.sequence import Sequence


class LoRAScheduler(ContinuousScheduler):
    def __init__(self, *args, max_loras: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_loras = max_loras

    def running_loras(self) -> set[int]:
        """The adapters of the running sequences (0, the base model, is none)."""
        return {seq.lora_int_id for seq in self.running} - {0}

    def over_lora_budget(self, seq: Sequence) -> bool:
        """Would `seq` bring one adapter too many into the step?"""
        loras = self.running_loras()
        return bool(seq.lora_int_id) and seq.lora_int_id not in loras \
            and len(loras) >= self.max_loras

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
