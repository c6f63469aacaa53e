"""Chapter 05: continuous batching, preemption, chunked prefill, abort, LLM."""
import http.client
import json
import threading

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.loadtest import run_load
from common.engine.detokenizer import IncrementalDetokenizer
from common.engine.output_processor import StopStrings
from common.entrypoints.llm import LLM
from common.loader import apply_chat_template
from common.sampling_params import SamplingParams
from tests.bad_inputs import assert_rejected_on_one_connection, bad_amid_good
from tests.conftest import PROMPTS, hf_greedy, wait_for
from tests.engine_helpers import fail_rows_seeded, greedy, make_engine, run_all

pytestmark = pytest.mark.ch05


@pytest.fixture(scope="module")
def prompts(embedded):
    return [apply_chat_template(embedded.tokenizer, m) for m in PROMPTS]


@pytest.mark.ex05
def test_mixed_arrivals_through_the_scheduler_equal_hf(embedded, prompts, impl):
    """Requests arriving at steps 0, 3 and 7, prefilled in chunks beside
    the others' decodes, give HF's greedy tokens."""
    engine = make_engine(embedded, max_num_batched_tokens=48, impl=impl)  # prefill chunks
    arrivals = {0: [0], 3: [1], 7: [2]}  # step -> prompts arriving
    done, step = {}, 0
    while step in arrivals or engine.has_unfinished_requests():
        for i in arrivals.get(step, []):
            engine.add_request(str(i), prompts[i], greedy(32))
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0]
        step += 1
    for i, ids in enumerate(prompts):
        assert done[str(i)].token_ids == hf_greedy(embedded.model, ids, 32)


@pytest.mark.ex04
@pytest.mark.ex05
def test_preemption_under_pressure_loses_nothing(tiny_llama, impl):
    """16 requests on a cache too small for them: preempted, recomputed,
    and every answer is what it is on a roomy cache."""
    ids = [[1 + (7 * i + j) % 500 for j in range(5 + i)] for i in range(16)]
    params = greedy(24, ignore_eos=True)
    roomy = run_all(make_engine(tiny_llama, block_size=4),
                    {str(i): p for i, p in enumerate(ids)}, params)
    tight = make_engine(tiny_llama, block_size=4, num_blocks=24, max_num_seqs=16, impl=impl)
    pressured = run_all(tight, {str(i): p for i, p in enumerate(ids)}, params)
    assert tight.scheduler.num_preemptions > 0
    assert len(pressured) == 16
    for request_id, output in roomy.items():
        assert pressured[request_id].token_ids == output.token_ids
    assert tight.block_manager.num_free_blocks == 24


@pytest.mark.ex05
def test_chunked_prefill_equals_single_prefill(embedded, impl):
    long_prompt = apply_chat_template(embedded.tokenizer, [
        {"role": "user", "content": "Summarize: " + "The cat sat on the mat. " * 30}])
    single = run_all(make_engine(embedded, max_num_batched_tokens=1024),
                     {"x": long_prompt}, greedy(16))["x"].token_ids
    chunked_engine = make_engine(embedded, max_num_batched_tokens=64, impl=impl)
    chunked = run_all(chunked_engine, {"x": long_prompt}, greedy(16))["x"].token_ids
    assert len(long_prompt) > 3 * 64 and chunked == single


@pytest.mark.ex04
@pytest.mark.ex05
def test_abort_in_the_middle_frees_blocks_and_others_finish(tiny_llama, impl):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64, impl=impl)
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
    # The entrypoints validate each request once with check_request.
    with pytest.raises(ValueError, match="never fit"):
        engine.check_request(19, greedy(8))
    with pytest.raises(ValueError, match="maximum context length"):
        engine.check_request(9, greedy(5000))


@pytest.fixture(scope="module")
def small_engine(tiny_llama, impl):
    return make_engine(tiny_llama, block_size=4, num_blocks=20, max_num_seqs=3,
                       max_num_batched_tokens=16, impl=impl)


@pytest.mark.ex05
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


def naive_earliest_stop(text: str, stops: list[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i != -1]
    return min(found) if found else None


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc ", max_size=30),
       stops=st.lists(st.text(alphabet="abc ", min_size=1, max_size=6), min_size=1, max_size=8))
def test_stop_strings_find_the_earliest_start_as_str_find_does(text, stops):
    assert StopStrings(stops).find(text) == naive_earliest_stop(text, stops)


def test_twenty_thousand_stop_strings_cost_a_step_what_one_does():
    """Searched one by one, 20,000 stop strings (a 1 MiB body holds more)
    cost every step of the request ~20,000 `str.find` calls; in one
    automaton built once, a search is one pass over the text whatever the
    number of strings. Counted, not timed."""
    many = StopStrings([f"stop{i}word" for i in range(20_000)])
    text = "the quick brown fox jumps over the lazy dog stop7word and stop12word"

    class CountingAutomaton:
        def __init__(self, automaton):
            self.automaton, self.passes = automaton, 0

        def iter(self, haystack):
            self.passes += 1
            return self.automaton.iter(haystack)

    many.automaton = CountingAutomaton(many.automaton)
    for _ in range(100):
        assert many.find(text) == text.index("stop7word")
    assert many.automaton.passes == 100  # one pass per search, not one per string


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
    # How many run at once depends on when they arrive; the batching itself
    # is checked with fixed arrivals in test_requests_arriving_together_run_together.


@pytest.mark.ex05
def test_requests_arriving_together_run_together(embedded, prompts, impl):
    engine = make_engine(embedded, max_num_batched_tokens=4096, num_blocks=256, impl=impl)
    for i in range(32):
        engine.add_request(str(i), prompts[i % 3], greedy(4, ignore_eos=True))
    engine.step()
    assert len(engine.scheduler.running) == 32
    assert len(run_all(engine)) == 32 and engine.stats.peak_running == 32


def test_a_dropped_non_streaming_request_is_aborted(ch05_server):
    """The client hangs up once its request runs: the abort follows from
    the disconnect, whatever the machine's speed."""
    body = json.dumps({"messages": PROMPTS[0], "max_tokens": 4000, "ignore_eos": True})
    conn = http.client.HTTPConnection(*ch05_server.url.split("//")[1].split(":"), timeout=60)
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})

    def stats():
        return requests.get(ch05_server.url + "/stats", timeout=60).json()

    aborted_before = stats()["finished"].get("abort", 0)
    wait_for(lambda: stats()["running"] == 1, "the request to run")
    conn.close()  # the client hangs up
    wait_for(lambda: stats()["running"] == 0 and stats()["waiting"] == 0, "the abort")
    final = stats()
    assert final["kv_used_slots"] == 0
    assert final["finished"].get("abort", 0) == aborted_before + 1


def test_a_long_prefill_does_not_starve_a_newcomer(ch05_server):
    """A 3,000-token prompt takes 12 steps of 256 tokens (the default cap,
    half the 512-token budget), not 6 of 512: a short request sent once it
    runs gets its answer while the long one is still prefilling (the engine
    has generated exactly one token since: the newcomer's). Without the
    cap it would wait for the whole prefill, and both would sample in the
    same step."""
    def stats():
        return requests.get(ch05_server.url + "/stats", timeout=60).json()

    long_messages = [{"role": "user", "content": "Summarize: " + "the sea is blue. " * 600}]
    url = ch05_server.url + "/v1/chat/completions"
    generated_before = stats()["generation_tokens"]
    long_answer: list = []
    thread = threading.Thread(target=lambda: long_answer.append(requests.post(
        url, json={"messages": long_messages, "max_tokens": 2, "temperature": 0},
        timeout=600)))
    thread.start()
    wait_for(lambda: stats()["running"] == 1, "the long prompt to run", timeout=300)
    short = requests.post(url, json={"messages": PROMPTS[0], "max_tokens": 1,
                                     "temperature": 0}, timeout=600)
    generated_since = stats()["generation_tokens"] - generated_before
    thread.join()
    assert short.status_code == 200 and long_answer[0].status_code == 200
    assert long_answer[0].json()["usage"]["prompt_tokens"] > 2500
    assert generated_since == 1  # the long prompt had not sampled yet


def test_ch05_hostile_input_amid_good_requests(ch05_server):
    assert_rejected_on_one_connection(ch05_server.url)
    texts = bad_amid_good(ch05_server.url)
    assert len(set(texts)) == 1 and "Paris" in texts[0]


def test_ch05_answers_like_chapter_06(ch05_server):
    """The same request path: stop strings cut, seed + k for n choices,
    1 MiB body limit."""
    url = ch05_server.url + "/v1/chat/completions"
    body = {"messages": PROMPTS[0], "temperature": 0, "max_tokens": 20, "stop": ["Paris"]}
    cut = requests.post(url, json=body, timeout=300).json()["choices"][0]
    assert "Paris" not in cut["message"]["content"] and cut["finish_reason"] == "stop"
    sampled = requests.post(url, json={"messages": PROMPTS[2], "temperature": 1.0, "n": 2,
                                       "seed": 7, "max_tokens": 16}, timeout=300).json()
    texts = [c["message"]["content"] for c in sampled["choices"]]
    assert texts[0] != texts[1]
    again = requests.post(url, json={"messages": PROMPTS[2], "temperature": 1.0, "seed": 8,
                                     "max_tokens": 16}, timeout=300).json()
    assert again["choices"][0]["message"]["content"] == texts[1]  # choice 1 = seed 8
    too_big = requests.post(url, data=b"x" * (2 * 1024 * 1024), timeout=300,
                            headers={"content-type": "application/json"})
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"


def test_one_failing_sequence_does_not_fail_the_batch(tiny_llama):
    """A fault while sampling one row, or while processing one request's
    output, finishes that request with an error; the others are untouched."""
    ids = {str(i): [1 + (5 * i + j) % 300 for j in range(6 + i)] for i in range(4)}
    params = greedy(12, ignore_eos=True)
    reference = run_all(make_engine(tiny_llama, block_size=4), ids, params)
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
    fail_rows_seeded(engine, seed=666)
    for request_id, prompt in ids.items():
        engine.add_request(request_id, prompt, params)
    engine.add_request("bad-row", ids["0"], greedy(12, ignore_eos=True, seed=666,
                                                   repetition_penalty=1.1))
    engine.add_request("bad-text", ids["1"], params)
    first = engine.step()  # the prefill: every request is in the batch; bad-row fails
    engine.output_processor.states["bad-text"].detokenizer.step = None  # not callable
    done = {o.request_id: o.outputs[0] for o in first if o.finished} | run_all(engine)
    assert done["bad-row"].finish_reason == "error" and "simulated" in done["bad-row"].error
    assert done["bad-text"].finish_reason == "error"
    for request_id, output in reference.items():
        assert done[request_id].token_ids == output.token_ids
    assert engine.block_manager.num_free_blocks == 64
    assert engine.stats.finished == {"error": 2, "length": 4}


def test_outputs_carry_deltas_or_only_the_final_answer(tiny_llama):
    """No output copies the whole sequence at every token."""
    from common.sampling_params import RequestOutputKind
    engine = make_engine(tiny_llama, block_size=4, num_blocks=64)
    prompt = list(range(1, 9))
    engine.add_request("delta", prompt, greedy(6, ignore_eos=True,
                                               output_kind=RequestOutputKind.DELTA))
    engine.add_request("final", prompt, greedy(6, ignore_eos=True))
    outputs = {"delta": [], "final": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id].append(output.outputs[0])
    assert [len(o.token_ids) for o in outputs["delta"]] == [1] * 6
    assert [o.num_output_tokens for o in outputs["delta"]] == [1, 2, 3, 4, 5, 6]
    assert len(outputs["final"]) == 1 and outputs["final"][0].finished
    assert outputs["final"][0].token_ids == [t for o in outputs["delta"] for t in o.token_ids]
    assert outputs["final"][0].text == "".join(o.text for o in outputs["delta"])
