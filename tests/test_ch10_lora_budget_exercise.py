"""Exercise 10b's grading tests: at most `--max-loras` adapters in a step
(`make exercise CH=10b`; the reference is `running_loras` and
`over_lora_budget` of `LoRAScheduler` in common/lora/scheduler.py).

Fake sequences first, no model: the two methods on running lists set by
hand, then the scheduler stepped with fake model outputs (as
tests/test_scheduler_unit.py does) until every request is done. The last
test builds the real engine with your scheduler, the embedded model and
two seeded random peft adapters in one slot: the model manager refuses a
step with more adapters than slots, so a scheduler that builds one
fails there.

Each test is built to catch a mistake learners make: the base model
(lora_int_id 0) counted as an adapter, the waiting queue's adapters
counted as if they held slots, a request of the base model held back, a
request of an adapter already running made to wait for a slot of its
own, and the budget off by one.
"""
from __future__ import annotations

import random

import pytest

from common.core.block_manager import BlockManager
from common.core.sequence import Sequence, SequenceStatus
from common.layers.sampler import SampledToken
from common.sampling_params import SamplingParams
from tests.adapters import lora_engine, peft_adapter

pytestmark = pytest.mark.ex10b

EOS = 0


def make(impl, max_loras: int, max_num_seqs: int = 16, num_blocks: int = 256):
    """The scheduler under test on a fresh block manager (blocks of 4)."""
    return impl.LoRAScheduler(BlockManager(num_blocks, 4), max_num_seqs, 64,
                              eos_token_ids={EOS}, max_model_len=1024, max_loras=max_loras)


def seq(request_id: str, lora_int_id: int, prompt_len: int = 3, max_tokens: int = 4) -> Sequence:
    return Sequence(request_id, list(range(1, prompt_len + 1)),
                    SamplingParams(max_tokens=max_tokens), lora_int_id=lora_int_id)


def running(sched, *lora_ids: int) -> None:
    """Put sequences of these adapters (0: the base model) in `running`, by hand."""
    sched.running = []
    for i, lora_id in enumerate(lora_ids):
        s = seq(f"run-{i}", lora_id)
        s.status = SequenceStatus.RUNNING
        sched.running.append(s)


def step(sched) -> list:
    """schedule, then a fake token for every sequence that samples.
    Returns the step's scheduled sequences."""
    batch = sched.schedule()
    sched.update_from_output(batch, {item.seq: [SampledToken(7)]
                                     for item in batch if item.samples})
    return [item.seq for item in batch]


def adapters_of(seqs) -> set[int]:
    return {s.lora_int_id for s in seqs} - {0}


# ------------------------------------------------ 1. who holds a slot
def test_the_running_adapters_leave_the_base_model_and_the_queue_out(impl):
    """The running sequences' adapters, each once; the base model (0) is
    none, and a waiting sequence holds no slot yet."""
    sched = make(impl, max_loras=4)
    running(sched, 0, 1, 1, 3)
    sched.add(seq("waiting", 2))
    assert sched.running_loras() == {1, 3}
    running(sched, 0, 0)
    assert sched.running_loras() == set(), "only the base model runs: no adapter"
    running(sched)
    assert sched.running_loras() == set()


# ------------------------------------------------ 2. what a request costs
def test_a_base_model_request_needs_no_slot(impl):
    """Every slot taken: a request of the base model is still never over
    the budget."""
    for max_loras, lora_ids in ((1, (5,)), (2, (1, 2, 0))):
        sched = make(impl, max_loras=max_loras)
        running(sched, *lora_ids)
        assert not sched.over_lora_budget(seq("base", 0)), (
            f"max_loras {max_loras}, running adapters {set(lora_ids) - {0}}: "
            "a base model request was held back")


def test_an_adapter_already_running_shares_its_slot(impl):
    """Every slot taken: a request of an adapter that is running already
    needs no slot of its own."""
    sched = make(impl, max_loras=2)
    running(sched, 1, 2, 2)
    for lora_id in (1, 2):
        assert not sched.over_lora_budget(seq("again", lora_id)), (
            f"adapter {lora_id} runs already, and its request was held back")


# ------------------------------------------------ 3. when the slots are full
@pytest.mark.parametrize("max_loras, lora_ids, over", [
    (2, (), False), (2, (1,), False), (2, (0, 1, 0), False), (2, (1, 2), True),
    (2, (1, 2, 0, 2), True), (1, (0,), False), (1, (4,), True), (3, (1, 2), False),
    (3, (1, 2, 4), True)])
def test_a_new_adapter_waits_only_when_every_slot_is_taken(impl, max_loras, lora_ids, over):
    """A request of adapter 9, not running: over the budget exactly when
    the running sequences' adapters fill all `max_loras` slots."""
    sched = make(impl, max_loras=max_loras)
    running(sched, *lora_ids)
    assert sched.over_lora_budget(seq("new", 9)) is over, (
        f"max_loras {max_loras}, running {lora_ids}: adapter 9 should "
        f"{'wait' if over else 'be admitted'}")


def test_a_step_never_holds_more_adapters_than_slots(impl):
    """30 requests over the base model and 5 adapters, in a seeded random
    order, max_loras 2: stepped with fake tokens until all are done, no
    step holds more than 2 adapters, and every request finishes."""
    rng = random.Random(10)
    sched = make(impl, max_loras=2, max_num_seqs=8)
    seqs = [seq(f"r{i}", rng.randrange(6), prompt_len=rng.randrange(2, 9),
                max_tokens=rng.randrange(1, 6)) for i in range(30)]
    for s in seqs:
        sched.add(s)
    for number in range(1, 500):
        scheduled = step(sched)
        assert len(adapters_of(scheduled)) <= 2, (
            f"step {number} runs adapters {sorted(adapters_of(scheduled))}, max_loras 2")
        if not sched.has_unfinished():
            break
    assert all(s.status is SequenceStatus.FINISHED for s in seqs), "requests left unfinished"


def test_requests_that_fit_go_past_a_held_back_one_which_keeps_its_place(impl):
    """max_loras 1: adapter 1 runs, adapter 2 waits; the base model and
    adapter 1's second request go past it; adapter 3, behind it, waits
    too. When adapter 1 is done, adapter 2 (first in line) runs next."""
    sched = make(impl, max_loras=1)
    for name, lora_id in (("one", 1), ("two", 2), ("base", 0), ("one-again", 1),
                          ("three", 3)):
        sched.add(seq(name, lora_id, max_tokens=3 if lora_id == 1 else 8))
    step(sched)
    assert [s.request_id for s in sched.running] == ["one", "base", "one-again"]
    assert [s.request_id for s in sched.waiting] == ["two", "three"]
    while any(s.lora_int_id == 1 for s in sched.running):
        step(sched)
    step(sched)
    assert adapters_of(sched.running) == {2}, f"running: {adapters_of(sched.running)}"
    assert [s.request_id for s in sched.waiting] == ["three"]


# ------------------------------------------------ in the engine
def test_the_engine_with_your_scheduler_keeps_each_step_within_its_slot(embedded, tmp_path,
                                                                       impl):
    """The embedded model, two seeded random peft adapters, one slot
    (max_loras 1): requests of adapter 1, adapter 2 and the base model.
    Adapter 2's waits while adapter 1's runs, the base model's does not;
    no step holds two adapters (the model manager would refuse it); all
    three finish with their 6 tokens."""
    from common.lora.request import LoRARequest
    from tests.engine_helpers import greedy
    for lora_id in (1, 2):
        peft_adapter(embedded.model, tmp_path / f"a{lora_id}", 4, 8, seed=lora_id)
    engine = lora_engine(embedded, impl, max_loras=1, max_lora_rank=8)
    for request_id, lora_id in (("one", 1), ("two", 2), ("base", 0)):
        lora = (LoRARequest(f"a{lora_id}", lora_id, str(tmp_path / f"a{lora_id}"))
                if lora_id else None)
        engine.add_request(request_id, [1, 2, 3, 4], greedy(6, ignore_eos=True),
                           lora_request=lora)
    finished = {}
    for number in range(1, 100):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = len(output.outputs[0].token_ids)
        if number == 1:
            assert [s.request_id for s in engine.scheduler.running] == ["one", "base"]
            assert [s.request_id for s in engine.scheduler.waiting] == ["two"]
        assert len(adapters_of(engine.scheduler.running)) <= 1
        if not engine.has_unfinished_requests():
            break
    assert finished == {"one": 6, "two": 6, "base": 6}
