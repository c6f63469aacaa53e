"""The scheduler alone, with fake model outputs and no model (as vLLM's
tests/v1/core do): admission limits, chunked prefill boundaries,
preemption order, static vs continuous, finishing and aborting."""
from __future__ import annotations

import pytest

from common.core.block_manager import BlockManager
from common.core.scheduler import StaticScheduler
from common.core.sequence import Sequence, SequenceStatus
from common.layers.sampler import SampledToken, SamplingFailed
from common.sampling_params import SamplingParams

pytestmark = pytest.mark.ch05

EOS = 0


@pytest.fixture
def make(impl):
    """make(cls, ...) -> a scheduler on a fresh block manager; cls defaults to
    the continuous scheduler under test (the reference or the learner's)."""
    def build(cls=None, num_blocks=16, block_size=4, max_num_seqs=8,
              max_num_batched_tokens=64, long_prefill_token_threshold=0):
        bm = BlockManager(num_blocks, block_size)
        return (cls or impl.ContinuousScheduler)(
            bm, max_num_seqs, max_num_batched_tokens, eos_token_ids={EOS}, max_model_len=1024,
            long_prefill_token_threshold=long_prefill_token_threshold)
    return build


def seq(request_id: str, prompt_len: int, max_tokens: int = 8, **params) -> Sequence:
    return Sequence(request_id, list(range(1, prompt_len + 1)),
                    SamplingParams(max_tokens=max_tokens, **params))


def steps_until(sched, done, limit: int = 200) -> int:
    """Step until `done()` holds; a scheduler that never gets there fails
    the test instead of hanging it. Returns the number of steps."""
    for count in range(1, limit + 1):
        step(sched)
        if done():
            return count
    raise AssertionError(f"still not there after {limit} steps")


def step(sched, token: int = 7):
    """schedule, then a fake model output: `token` for every sequence that
    samples. Returns {request id: tokens fed} and the updated sequences."""
    batch = sched.schedule()
    sampled = {item.seq: [SampledToken(token)] for item in batch if item.samples}
    updated = sched.update_from_output(batch, sampled)
    return {item.seq.request_id: item.num_new_tokens for item in batch}, updated


@pytest.mark.ex05
def test_admission_stops_at_max_num_seqs(make):
    sched = make(max_num_seqs=2)
    for i in range(3):
        sched.add(seq(str(i), 3))
    fed, _ = step(sched)
    assert fed == {"0": 3, "1": 3}
    assert [s.request_id for s in sched.waiting] == ["2"]


@pytest.mark.ex05
def test_chunked_prefill_boundaries_and_sampling_only_at_the_last_chunk(make):
    sched = make(max_num_batched_tokens=4)
    long = seq("long", 10)
    sched.add(long)
    plan = []
    for _ in range(4):
        fed, updated = step(sched)
        plan.append((fed["long"], long.num_computed_tokens, long.num_output_tokens))
    # chunks of 4, 4, 2 (the last samples), then one decode token
    assert plan == [(4, 4, 0), (4, 8, 0), (2, 10, 1), (1, 11, 2)]


@pytest.mark.ex05
def test_the_token_budget_is_shared_by_decodes_and_a_new_prefill(make):
    sched = make(max_num_batched_tokens=6)
    sched.add(seq("a", 2))
    sched.add(seq("b", 2))
    step(sched)  # both prefilled
    sched.add(seq("c", 10))
    fed, _ = step(sched)
    assert fed == {"a": 1, "b": 1, "c": 4}  # 2 decodes + the first 4 of c's prompt


@pytest.mark.ex05
def test_the_budget_is_spent_to_its_last_token(make):
    """A budget of 3: three 1-token prompts are all admitted, then all three
    decode; with two decoding, a newcomer's prompt gets the last token."""
    sched = make(max_num_batched_tokens=3)
    for name in "abc":
        sched.add(seq(name, 1, max_tokens=20, ignore_eos=True))
    assert step(sched)[0] == {"a": 1, "b": 1, "c": 1}, "admit while any budget is left"
    assert step(sched)[0] == {"a": 1, "b": 1, "c": 1}, "feed running while any budget is left"
    sched.finish(sched.running[-1], "abort")
    sched.add(seq("d", 5))
    assert step(sched)[0] == {"a": 1, "b": 1, "d": 1}, "the last token starts d's prompt"


@pytest.mark.ex05
def test_admission_waits_for_free_blocks(make):
    sched = make(num_blocks=3, block_size=4)
    sched.add(seq("a", 8))  # 2 blocks
    sched.add(seq("b", 8))  # 2 more: only 1 free
    fed, _ = step(sched)
    assert fed == {"a": 8} and [s.request_id for s in sched.waiting] == ["b"]


@pytest.mark.ex05
def test_preemption_takes_the_newest_and_requeues_it_first(make):
    sched = make(num_blocks=4, block_size=4)
    a, b = seq("a", 4, max_tokens=20), seq("b", 4, max_tokens=20)
    c = seq("c", 13, max_tokens=2)  # 4 blocks: waits while a and b run
    for s in (a, b, c):
        sched.add(s)
    steps = steps_until(sched, lambda: sched.num_preemptions > 0)
    # 2 blocks each fill up at 8 tokens; the 9th needs a third: none is free.
    assert steps == 6 and sched.num_preemptions == 1
    assert b.status is SequenceStatus.WAITING
    assert list(sched.waiting) == [b, c]  # back at the front: b came before c
    assert b.num_computed_tokens == 0 and b.block_table == []
    assert a.status is SequenceStatus.RUNNING and len(a.block_table) == 3
    assert b.num_preemptions == 1 and b.num_output_tokens == 5  # its outputs are kept


@pytest.mark.ex05
def test_every_preemption_is_counted(make):
    """The same sequence preempted twice: 2 on the sequence and 2 on the
    scheduler (vllm:num_preemptions_total, and how a step knows it preempted)."""
    sched = make()
    a, b = seq("a", 4, max_tokens=20), seq("b", 4, max_tokens=20)
    sched.add(a)
    sched.add(b)
    step(sched)
    for count in (1, 2):
        sched.preempt(b)
        assert (b.num_preemptions, sched.num_preemptions) == (count, count)
        assert b.status is SequenceStatus.WAITING and b.block_table == []
        step(sched)  # b back in
        assert b.status is SequenceStatus.RUNNING
    assert a.num_preemptions == 0


@pytest.mark.ex05
def test_a_preempted_sequence_recomputes_prompt_and_outputs(make):
    sched = make(num_blocks=4, block_size=4)
    # 4 + 8 tokens = 3 blocks each: both fit alone, not together.
    a, b = seq("a", 4, max_tokens=8, ignore_eos=True), seq("b", 4, max_tokens=8)
    sched.add(a)
    sched.add(b)
    steps_until(sched, lambda: sched.num_preemptions > 0)
    tokens_of_b = b.num_tokens
    fed = {}
    for _ in range(200):
        fed, _ = step(sched)
        if b.status is SequenceStatus.RUNNING:
            break
    assert a.finish_reason == "length"  # b came back once a had finished
    assert fed["b"] == tokens_of_b  # the re-prefill: prompt + outputs so far


def test_static_batches_wait_for_the_whole_batch(make):
    sched = make(StaticScheduler)
    sched.add(seq("long", 3, max_tokens=5, ignore_eos=True))
    sched.add(seq("short", 3, max_tokens=1))
    step(sched)  # both admitted; short finishes at once (max_tokens 1)
    sched.add(seq("late", 3))
    admitted_late = []
    for _ in range(200):
        if not sched.has_unfinished():
            break
        fed, _ = step(sched)
        admitted_late.append("late" in fed)
    # late joins only once long has finished: 4 more steps of long first
    assert admitted_late == [False] * 4 + [True] * (len(admitted_late) - 4)


@pytest.mark.ex05
def test_continuous_lets_a_late_request_join_at_the_next_step(make):
    sched = make()
    sched.add(seq("long", 3, max_tokens=5))
    step(sched)
    sched.add(seq("late", 3))
    fed, _ = step(sched)
    assert fed == {"long": 1, "late": 3}


@pytest.mark.ex05
@pytest.mark.parametrize("cap, first_token_step", [(0, 5), (6, 2), (1, 4)])
def test_a_long_prefill_leaves_room_for_a_newcomer(make, cap, first_token_step):
    """A 40-token prompt, a budget of 10: without a cap it takes the whole
    budget for 4 steps and a 3-token newcomer's first token waits for the
    5th; capped at 6 tokens per step, the newcomer joins at once; capped at
    1, it joins at once too but feeds its own prompt 1 token a step (step 4)."""
    sched = make(num_blocks=32, max_num_batched_tokens=10, long_prefill_token_threshold=cap)
    long, late = seq("long", 40), seq("late", 3)
    sched.add(long)
    fed, _ = step(sched)
    assert fed == {"long": cap or 10}
    sched.add(late)
    steps = steps_until(sched, lambda: late.num_output_tokens == 1)
    assert steps + 1 == first_token_step
    assert long.num_output_tokens == 0 or cap == 0  # the long prompt still prefilling


def test_static_admission_reserves_the_worst_case(make):
    sched = make(StaticScheduler, num_blocks=4, block_size=4)
    sched.add(seq("a", 4, max_tokens=8))  # worst case 12 tokens = 3 blocks
    sched.add(seq("b", 4, max_tokens=8))  # 3 more: does not fit with a
    fed, _ = step(sched)
    assert fed == {"a": 4}  # b waits although 3 blocks are free right now


@pytest.mark.ex05
def test_update_finishes_on_eos_length_stop_token_and_failure(make):
    sched = make()
    eos, length = seq("eos", 3), seq("length", 3, max_tokens=1)
    stop_id, failed = seq("stop_id", 3, stop_token_ids=[42]), seq("failed", 3)
    for s in (eos, length, stop_id, failed):
        sched.add(s)
    batch = sched.schedule()
    sampled = {eos: [SampledToken(EOS)], length: [SampledToken(5)], stop_id: [SampledToken(42)],
               failed: SamplingFailed(RuntimeError("boom"))}
    updated = sched.update_from_output(batch, sampled)
    assert set(updated) == {eos, length, stop_id, failed}
    assert [s.finish_reason for s in (eos, length, stop_id, failed)] == [
        "stop", "length", "stop", "error"]
    assert "boom" in failed.error and failed.num_output_tokens == 0
    assert not sched.running and sched.bm.num_free_blocks == sched.bm.num_blocks


@pytest.mark.ex05
def test_abort_from_waiting_and_from_running_frees_everything(make):
    sched = make(max_num_seqs=1)
    running, waiting = seq("running", 5), seq("waiting", 5)
    sched.add(running)
    sched.add(waiting)
    step(sched)
    sched.finish(running, "abort")
    sched.finish(waiting, "abort")
    assert not sched.has_unfinished()
    assert sched.bm.num_free_blocks == sched.bm.num_blocks
    assert running.finish_reason == waiting.finish_reason == "abort"
