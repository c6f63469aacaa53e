"""Chapter 05: continuous batching, preemption, chunked prefill, abort, LLM."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.engine.detokenizer import IncrementalDetokenizer
from common.entrypoints.llm import LLM
from common.loader import apply_chat_template
from bench.loadtest import run_load
from common.sampling_params import SamplingParams
from tests.conftest import PROMPTS, hf_greedy
from tests.engine_helpers import greedy, make_engine, run_all

pytestmark = pytest.mark.ch05


@pytest.fixture(scope="module")
def prompts(embedded):
    return [apply_chat_template(embedded.tokenizer, m) for m in PROMPTS]


def test_mixed_arrivals_through_the_scheduler_equal_hf(embedded, prompts):
    engine = make_engine(embedded, max_num_batched_tokens=48)  # forces prefill chunks
    arrivals = {0: [0], 3: [1], 7: [2]}  # step -> prompts arriving
    done, step = {}, 0
    while step in arrivals or engine.has_unfinished_requests():
        for i in arrivals.get(step, []):
            engine.add_request(str(i), prompts[i], greedy(32))
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
        step += 1
    for i, ids in enumerate(prompts):
        assert done[str(i)].token_ids == hf_greedy(embedded.model, ids, 32)


def test_preemption_under_pressure_loses_nothing(tiny_llama):
    ids = [[1 + (7 * i + j) % 500 for j in range(5 + i)] for i in range(16)]
    params = greedy(24, ignore_eos=True)
    roomy = run_all(make_engine(tiny_llama, block_size=4),
                    {str(i): p for i, p in enumerate(ids)}, params)
    tight = make_engine(tiny_llama, block_size=4, num_blocks=24, max_num_seqs=16)
    pressured = run_all(tight, {str(i): p for i, p in enumerate(ids)}, params)
    assert tight.scheduler.num_preemptions > 0
    assert len(pressured) == 16
    for request_id, output in roomy.items():
        assert pressured[request_id].token_ids == output.token_ids
    assert tight.block_manager.num_free_blocks == 24


def test_chunked_prefill_equals_single_prefill(embedded):
    long_prompt = apply_chat_template(embedded.tokenizer, [
        {"role": "user", "content": "Summarize: " + "The cat sat on the mat. " * 30}])
    single = run_all(make_engine(embedded, max_num_batched_tokens=1024),
                     {"x": long_prompt}, greedy(16))["x"].token_ids
    chunked_engine = make_engine(embedded, max_num_batched_tokens=64)
    chunked = run_all(chunked_engine, {"x": long_prompt}, greedy(16))["x"].token_ids
    assert len(long_prompt) > 3 * 64 and chunked == single


def test_abort_in_the_middle_frees_blocks_and_others_finish(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
    engine.add_request("a", list(range(1, 30)), greedy(40, ignore_eos=True))
    engine.add_request("b", list(range(5, 12)), greedy(10, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort("a")
    done = run_all(engine)
    assert list(done) == ["b"] and len(done["b"].token_ids) == 10
    assert engine.block_manager.num_free_blocks == 64


def test_a_prompt_that_can_never_fit_is_refused_at_once(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=4)
    with pytest.raises(ValueError, match="never fit"):
        engine.add_request("big", list(range(1, 20)), greedy(8))
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_request("huge", list(range(1, 10)), greedy(5000))


@pytest.fixture(scope="module")
def small_engine(tiny_llama):
    return make_engine(tiny_llama, block_size=4, num_blocks=20, max_num_seqs=3,
                       max_num_batched_tokens=16)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 30), st.integers(1, 12)),
                min_size=1, max_size=8))
def test_scheduler_never_exceeds_its_limits(small_engine, requests):
    """requests: (arrival step, prompt length, max_tokens)."""
    engine, sched = small_engine, small_engine.scheduler
    original = sched.schedule
    seen = []

    def checked_schedule():
        batch = original()
        assert len(batch) <= 3 and len(sched.running) <= 3
        assert sum(item.num_new_tokens for item in batch) <= 16
        assert engine.block_manager.num_used_blocks <= 20
        seen.append(len(batch))
        return batch

    sched.schedule = checked_schedule
    try:
        step, pending = 0, sorted(enumerate(requests), key=lambda r: r[1][0])
        done = set()
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][1][0] <= step:
                i, (_, length, max_tokens) = pending.pop(0)
                engine.add_request(f"{id(requests)}-{i}", [1 + k for k in range(length)],
                                   greedy(max_tokens, ignore_eos=True))
            done.update(o.request_id for o in engine.step() if o.finished)
            step += 1
        assert len(done) == len(requests)
        assert engine.block_manager.num_free_blocks == 20
    finally:
        sched.schedule = original


def test_incremental_detokenizer_never_splits_a_character(embedded):
    text = "Café 🍕 naïve — ok ✓"
    ids = embedded.tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(embedded.tokenizer)
    pieces = [detok.step(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_offline_llm_generate_and_chat(embedded, prompts):
    llm = LLM(loaded=embedded, device_memory_gb=2.0)
    outputs = llm.generate([prompts[0], "The capital of Italy is"],
                           SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert "Paris" in outputs[0].outputs[0].text and outputs[1].prompt == "The capital of Italy is"
    chat = llm.chat(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert chat[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def ch05_server(start_server):
    server = start_server("05", "--device-memory-gb", "1.1")
    yield server
    server.stop()


def test_ch05_survives_the_load_that_crashed_chapter_02(ch05_server):
    summary = run_load(ch05_server.url, 2, 1, max_tokens=16, timeout=300, deadline=600)
    assert summary["failed"] == 0
    summary = run_load(ch05_server.url, 32, 2, max_tokens=8, timeout=600, deadline=900)
    assert summary["failed"] == 0 and summary["completed"] == 64
    assert summary["server_stats"]["peak_running"] > 8


def test_a_dropped_non_streaming_request_is_aborted(ch05_server):
    import time

    import requests
    try:
        requests.post(ch05_server.url + "/v1/chat/completions", timeout=2, json={
            "messages": PROMPTS[0], "max_tokens": 2000, "ignore_eos": True})
    except requests.Timeout:
        pass  # the client hangs up after 2 s
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        stats = requests.get(ch05_server.url + "/stats").json()
        if stats["running"] == 0 and stats["waiting"] == 0:
            break
        time.sleep(0.2)
    assert stats["running"] == 0 and stats["kv_used_slots"] == 0
    assert stats["finished"].get("abort", 0) >= 1
