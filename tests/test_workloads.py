"""The comparison with the real vLLM, without a server: its seeded loads
(bench/workloads.py), the steady-state loop (bench/loadtest.py
`run_for_duration`, on a clock of its own) and the ratios' arithmetic
(bench/vs_vllm.py)."""
import threading

import pytest

from bench import workloads
from bench.loadtest import RequestResult, run_for_duration
from bench.vs_vllm import compare
from bench.workloads import SUMMARIZE, WORKLOADS, Client, token_count

pytestmark = pytest.mark.bench


def contents(conversation) -> list[str]:
    return [m["content"] for m in conversation.messages([""] * (len(conversation.turns) - 1))]


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_a_load_is_the_same_for_a_seed_and_differs_across_clients(name):
    load = WORKLOADS[name]
    first = load.conversation(0, 3, 2)
    workloads._document.cache_clear()  # made again, not remembered
    assert load.conversation(0, 3, 2) == first
    assert load.conversation(0, 4, 2) != first
    assert load.conversation(0, 3, 3) != first
    if name != "shared-prefix":  # every one of its requests starts the same
        assert contents(load.conversation(1, 3, 2))[-1][:200] != contents(first)[-1][:200]


def test_long_documents_are_1000_to_1500_tokens():
    load = WORKLOADS["long"]
    lengths = [token_count(load.conversation(0, c, i).turns[0].removesuffix(f"\n\n{SUMMARIZE}"))
               for c in range(4) for i in range(3)]
    assert all(1000 <= n <= 1500 for n in lengths), lengths
    assert len(set(lengths)) > 1  # drawn, not fixed


def test_shared_prefix_requests_share_their_first_1000_tokens_exactly():
    load = WORKLOADS["shared-prefix"]
    encode = workloads.tokenizer().encode
    ids = [encode(load.conversation(0, c, i).turns[0], add_special_tokens=False)
           for c, i in [(0, 0), (1, 0), (5, 7)]]
    assert ids[0][:1000] == ids[1][:1000] == ids[2][:1000]
    assert ids[0][1000:] != ids[1][1000:] != ids[2][1000:]
    assert all(20 <= len(i) - 1000 <= 40 for i in ids)  # the question after the document
    other_seed = encode(load.conversation(1, 0, 0).turns[0], add_special_tokens=False)
    assert other_seed[:1000] != ids[0][:1000]


def test_multi_turn_resends_the_history_then_starts_a_new_conversation():
    load = WORKLOADS["multi-turn"]
    client = Client(load, seed=0, client=2)
    first = client.next_messages()
    assert [m["role"] for m in first] == ["system", "user"]
    assert 400 <= token_count(first[1]["content"]) <= 420
    client.answered("answer one")
    second = client.next_messages()
    assert second[:2] == first
    assert second[2] == {"role": "assistant", "content": "answer one"}
    assert second[3]["role"] == "user" and len(second) == 4
    for answer in ("answer two", "answer three"):
        client.answered(answer)
    last = client.next_messages()
    assert [m["content"] for m in last if m["role"] == "assistant"] == [
        "answer one", "answer two", "answer three"]
    client.answered("answer four")  # the fourth turn ends it
    fresh = client.next_messages()
    assert len(fresh) == 2 and fresh[1] != first[1]
    assert fresh == load.conversation(0, 2, 1).messages([])


def test_each_load_gives_vllm_bench_serve_its_clients_and_answer_length():
    for load in WORKLOADS.values():
        command = load.vllm_bench_command(num_prompts=99)
        assert command.startswith("vllm bench serve --backend openai-chat")
        assert f"--max-concurrency {load.clients} " in command
        assert "--num-prompts 99 " in command and "--ignore-eos" in command
        assert f"-output-len {load.max_tokens}" in command
    assert "--dataset-name prefix_repetition" in WORKLOADS["shared-prefix"].vllm_bench_command()
    long = WORKLOADS["long"].vllm_bench_command()
    assert "--random-input-len 1250" in long and '"input": 0.2' in long


def test_a_long_prompts_run_lasts_long_enough_for_a_second_round():
    """A long prompt's request takes about 30 s on 2 cores: its loads run
    60 s, so that the second round of requests starts out of step."""
    assert {name: load.duration_s for name, load in WORKLOADS.items()} == {
        "chat-32": 30.0, "chat-64": 30.0, "long": 60.0, "shared-prefix": 60.0,
        "multi-turn": 60.0}


def run(tokens_per_s: float, ttft: float | None = 0.5, failed: int = 0) -> dict:
    return {"output_tokens_per_s": tokens_per_s, "ttft_p50_s": ttft, "ttft_p95_s": ttft,
            "itl_p50_s": 0.1, "itl_p95_s": 0.2, "e2e_p50_s": 2.0, "e2e_p95_s": 3.0,
            "prefix_cache_hit_rate": None, "failed": failed, "preemptions": 1}


def test_the_ratio_its_median_and_spread_pair_by_pair():
    ours = [run(120.0, 0.4), run(90.0, 0.6), run(110.0, None)]
    theirs = [run(100.0), run(100.0), run(50.0, failed=2)]
    c = compare(ours, theirs)
    assert c["ratios"] == pytest.approx([1.2, 0.9, 2.2])
    assert c["ratio_median"] == pytest.approx(1.2)
    assert (c["ratio_min"], c["ratio_max"]) == pytest.approx((0.9, 2.2))
    assert c["ch06"]["output_tokens_per_s"] == 110.0
    assert c["ch06"]["ttft_p50_s"] == pytest.approx(0.5)  # the runs that have one
    assert c["vllm"]["prefix_cache_hit_rate"] is None
    assert (c["vllm"]["failed"], c["vllm"]["preemptions"]) == (2, 3)


class FakeClock:
    """Time that moves only when a fake request takes it."""

    def __init__(self):
        self.now, self.lock = 100.0, threading.Lock()

    def __call__(self) -> float:
        return self.now

    def take(self, seconds: float) -> float:
        with self.lock:
            started, self.now = self.now, self.now + seconds
        return started


@pytest.mark.parametrize("clients", [1, 3])
def test_the_duration_loop_stops_starting_requests_after_the_duration(clients):
    clock, started = FakeClock(), []

    def send(c: int, r: int) -> RequestResult:
        started.append(clock.take(1.0) - 100.0)  # each request takes a second
        return RequestResult(True, e2e=1.0, ttft=0.1, completion_tokens=8, itls=[0.1, 0.3])

    summary = run_for_duration(send, clients, duration_s=10.0, clock=clock)
    assert started and max(started) < 10.0
    assert summary["duration_s"] == clock.now - 100.0 >= 10.0
    assert summary["output_tokens_per_s"] == pytest.approx(8 * len(started) / summary["duration_s"])
    assert summary["itl_p95_s"] == 0.3
    if clients == 1:
        assert len(started) == 10 and summary["duration_s"] == 10.0
