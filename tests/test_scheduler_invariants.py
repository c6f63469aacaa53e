"""The scheduler's invariants, under random workloads (hypothesis): random
arrivals, prompt lengths and shared openings, aborts, tiny pools, small
budgets, chunked prefill with and without a cap on long prompts, prefix
caching on and off. A fake model stands in for the forward pass: it
writes each fed token's K/V into tests/invariants.py's `KVShadow`, and
samples a token that depends on the whole sequence.

After every step: the batch respects the token budget and `max_num_seqs`;
every fed token has a slot; no waiting sequence holds blocks; preemption
takes the newest; the block manager's invariants hold and every computed
token reads its own K/V. At the end: every request finished with the
tokens the fake model gives it alone, and every block is free.

Graded: ex05 (the learner's scheduler on the reference block manager) and
ex04 (the reference scheduler on the learner's block manager).
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.core.block_manager import BlockManager
from common.core.scheduler import StaticScheduler
from common.core.sequence import Sequence, SequenceStatus
from common.layers.sampler import SampledToken
from common.outputs import FinishReason
from common.sampling_params import SamplingParams
from tests.invariants import (Before, InvariantError, KVShadow, check_block_manager,
                              check_scheduler_step)

pytestmark = pytest.mark.ch05

PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=120,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

EOS = 0  # the fake model never samples it: requests end at max_tokens
OPENINGS = [(), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9, 9, 9)]


def fake_model_token(token_ids) -> int:
    """The token a deterministic model samples after `token_ids`."""
    return 1 + hash(tuple(token_ids)) % 5


def expected_output(prompt, max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(fake_model_token(tokens))
    return tokens[len(prompt):]


def fake_step(sched, shadow: KVShadow) -> list:
    """schedule(), check it, run the fake model, update_from_output()."""
    before = Before.of(sched)
    batch = sched.schedule()
    check_scheduler_step(sched, batch, before)
    sampled = {}
    for item in batch:
        seq = item.seq
        start = seq.num_computed_tokens
        shadow.write(sched.bm, seq, start, start + item.num_new_tokens)
        if start + item.num_new_tokens == seq.num_tokens:  # its last token is in: it samples
            sampled[seq] = [SampledToken(fake_model_token(seq.token_ids))]
    sched.update_from_output(batch, sampled)
    check_block_manager(sched.bm, sched.running, shadow)
    return batch


POLICIES = [
    pytest.param("continuous", marks=[pytest.mark.ex05, pytest.mark.ex04]),
    pytest.param("static", marks=pytest.mark.ex04),
]



@pytest.mark.ex05
def test_a_preempted_sequence_recomputes_from_its_cached_prefix(impl):
    """Preempted: it holds nothing while it waits, then comes back with
    prompt + outputs to recompute, and finishes with the same tokens."""
    bm = BlockManager(6, 2)
    sched = impl.ContinuousScheduler(bm, max_num_seqs=4, max_num_batched_tokens=16,
                                     eos_token_ids={EOS}, max_model_len=1024)
    shadow = KVShadow()
    old = Sequence("old", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    new = Sequence("new", [3, 3, 3, 3], SamplingParams(max_tokens=4))
    sched.add(old)
    sched.add(new)
    preempted_at = None
    for step in range(30):
        if not sched.has_unfinished():
            break
        fake_step(sched, shadow)
        if new.num_preemptions and preempted_at is None:
            preempted_at = new.num_output_tokens
            assert new in sched.waiting and not new.block_table
    assert new.num_preemptions >= 1 and preempted_at is not None
    assert old.num_preemptions == 0, "the newest is preempted, not the oldest"
    assert old.output_token_ids == expected_output([1, 2, 3, 4, 5], 4)
    assert new.output_token_ids == expected_output([3, 3, 3, 3], 4)
    assert bm.num_free_blocks == 6


@pytest.mark.ex05
def test_nobody_joins_in_a_step_that_preempts(impl):
    """With prefix caching, a sequence preempted to make room can find its
    own blocks still cached and fit again at once: admitting it (or anyone)
    in the step that preempted it frees room only to fill it, over and
    over. Under pressure, no admission until the next step."""
    bm = BlockManager(5, 2, enable_prefix_caching=True)
    sched = impl.ContinuousScheduler(bm, max_num_seqs=4, max_num_batched_tokens=16,
                                     eos_token_ids={EOS}, max_model_len=1024)
    shadow = KVShadow()
    first = Sequence("first", [1, 1], SamplingParams(max_tokens=6))
    second = Sequence("second", [1, 1], SamplingParams(max_tokens=5))
    sched.add(first)
    sched.add(second)
    for _ in range(40):
        if not sched.has_unfinished():
            break
        fake_step(sched, shadow)  # checks each step: nobody joins when one is preempted
    assert second.num_preemptions >= 1, "the scenario must preempt"
    assert first.output_token_ids == expected_output([1, 1], 6)
    assert second.output_token_ids == expected_output([1, 1], 5)


@pytest.mark.parametrize("policy", POLICIES)
@PROPERTY
@given(data=st.data())
def test_scheduler_invariants_under_random_workloads(impl, policy, data):
    """Random arrivals, lengths, shared openings and aborts on a tiny pool:
    after every step the budget, max_num_seqs and the block manager's
    invariants hold, no waiting sequence holds blocks, preemption takes the
    newest and every computed token reads its own K/V; at the end every
    request has the tokens it gets alone and every block is free."""
    block_size = data.draw(st.sampled_from([1, 2, 4]), label="block_size")
    num_blocks = data.draw(st.integers(4, 16), label="num_blocks")
    prefix_caching = data.draw(st.booleans(), label="prefix_caching")
    bm = impl.BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    cls = impl.ContinuousScheduler if policy == "continuous" else StaticScheduler
    sched = cls(bm, max_num_seqs=data.draw(st.integers(1, 4), label="max_num_seqs"),
                max_num_batched_tokens=data.draw(st.integers(1, 12), label="budget"),
                eos_token_ids={EOS}, max_model_len=1024,
                long_prefill_token_threshold=data.draw(st.sampled_from([0, 0, 2, 3]),
                                                       label="long_prefill_token_threshold"))
    capacity = num_blocks * block_size  # a request must fit the pool alone
    shadow = KVShadow()
    requests: dict[str, tuple[Sequence, list[int]]] = {}
    aborted: set[str] = set()
    num_requests = data.draw(st.integers(1, 6), label="requests")
    for step in range(400):
        if len(requests) < num_requests and (not sched.has_unfinished() or data.draw(
                st.booleans(), label=f"arrives {step}")):
            opening = data.draw(st.sampled_from(OPENINGS), label="opening")
            tail = data.draw(st.lists(st.integers(1, 3), max_size=5), label="tail")
            prompt = (list(opening) + tail or [1])[:capacity - 1]
            max_tokens = data.draw(st.integers(1, min(6, capacity - len(prompt))),
                                   label="max_tokens")
            seq = Sequence(f"r{len(requests)}", prompt, SamplingParams(max_tokens=max_tokens))
            requests[seq.request_id] = (seq, expected_output(prompt, max_tokens))
            sched.add(seq)
        if (sched.has_unfinished() and data.draw(st.integers(0, 15), label=f"abort {step}") == 0):
            victim = data.draw(st.sampled_from(list(sched.waiting) + sched.running), label="victim")
            sched.finish(victim, FinishReason.ABORT)
            aborted.add(victim.request_id)
            check_block_manager(sched.bm, sched.running, shadow)
        if not sched.has_unfinished():
            if len(requests) == num_requests:
                break
            continue  # all aborted: the next one arrives
        if not fake_step(sched, shadow):
            raise InvariantError(
                f"step {step}: nothing scheduled with {len(sched.waiting)} waiting and "
                f"{len(sched.running)} running, {bm.num_free_blocks} free blocks: stuck")
    else:
        raise InvariantError("requests still unfinished after 400 steps")
    for request_id, (seq, expected) in requests.items():
        assert seq.status is SequenceStatus.FINISHED, request_id
        if request_id not in aborted:
            assert seq.output_token_ids == expected, (
                f"request {request_id}: tokens {seq.output_token_ids}, alone it gets {expected} "
                f"(preempted {seq.num_preemptions} times)")
    assert bm.num_free_blocks == num_blocks, "blocks not given back at the end"
    assert all(block.ref_count == 0 for block in bm.blocks)
