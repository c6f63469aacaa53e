"""Chapter 09, section 1: the engine core in processes of its own.

- what crosses between the processes (common/engine/serial.py) comes back
  equal, and nothing else crosses;
- `AsyncMPClient` with two engine processes gives HF's greedy float32
  tokens, spreads requests over both, and adds their figures up;
- the API server answers `/health` and a bad request's 400 while an engine
  is in the middle of a 7,000-token prefill (checked by order of events:
  both answers come before the prefill's first token);
- a client gone mid-stream frees its blocks in the engine's process;
- a killed engine process: the stream in flight ends with `engine_dead`,
  `/health` says 503 (or the server is already gone), the server exits 1
  and takes its other engine with it; nothing hangs;
- an engine that cannot be built (a flag that does not fit the model) is
  a usage error, exit 2, as in chapter 08.

The chapter 06 suite (tests/test_ch06_server.py) also runs unchanged on
chapter 09 with two engine processes.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest
import requests

from common.config import EngineConfig
from common.engine.core import EngineCoreSpec
from common.engine.core_client import AsyncMPClient, combine_snapshots
from common.engine.serial import decode, encode
from common.metrics.stats import FinishedRequestStats, IterationStats
from common.layers.sampler import SampledToken
from common.loader import apply_chat_template
from common.outputs import CompletionOutput, FinishReason, RequestOutput
from common.sampling_params import SamplingParams, StructuredOutputsParams
from tests.conftest import PROMPTS, ROOT, hf_greedy, wait_for

pytestmark = pytest.mark.ch09


# ------------------------------------------------------------ the wire
def test_requests_and_outputs_cross_unchanged():
    params = SamplingParams(temperature=0.7, top_k=5, logit_bias={11: -2.5}, stop=["."],
                            seed=3, max_tokens=9, logprobs=2,
                            structured_outputs=StructuredOutputsParams(choice=("yes", "no")))
    assert decode(encode(params)) == params
    assert decode(encode(params)).structured_outputs.choice == ("yes", "no")  # a tuple still
    output = RequestOutput("r-1", None, [1, 2, 3], [CompletionOutput(
        0, " Paris", [42], [SampledToken(42, -0.25, [(42, -0.25), (7, -3.0)])],
        FinishReason.STOP, 1)], finished=True, num_cached_tokens=16,
        prompt_logprobs=[None, SampledToken(2, -1.5, [(5, -0.5)], rank=3)])
    assert decode(encode(output)) == output
    stats = IterationStats(12.5)
    stats.time_to_first_tokens_iter.append(0.5)
    stats.prompt_token_stats.update(num_prompt_tokens=40, num_cached_tokens=32)
    stats.finished_requests.append(FinishedRequestStats(
        "r-1", FinishReason.LENGTH, 1.0, 3, 1, 1, 0.1, 0.2, 0.3, 0.0, 0.0))
    assert vars(decode(encode(stats))) == vars(stats)


def test_nothing_else_crosses():
    with pytest.raises(TypeError, match="does not cross"):
        encode({"payload": threading.Lock()})


def test_figures_of_several_engines_add_up():
    one = {"block_size": 16, "num_blocks": 100, "running": 2, "kv_cache_usage_perc": 10.0,
           "prefix_cache_queried_blocks": 4, "prefix_cache_hit_blocks": 3,
           "prefix_cache_hit_rate": 0.75, "finished": {"stop": 1},
           "iteration_tokens": {"bounds": [1, 8], "counts": [5, 1]}}
    two = {**one, "running": 1, "kv_cache_usage_perc": 30.0, "prefix_cache_hit_blocks": 1,
           "prefix_cache_hit_rate": 0.25, "finished": {"stop": 2},
           "iteration_tokens": {"bounds": [1, 8], "counts": [2, 0]}}
    combined = combine_snapshots([one, two])
    assert combined["block_size"] == 16 and combined["num_blocks"] == 200
    assert combined["running"] == 3 and combined["kv_cache_usage_perc"] == 20.0
    assert combined["prefix_cache_hit_rate"] == 0.5  # 4 hits of 8 queried, not 0.75 + 0.25
    assert combined["finished"] == {"stop": 3}
    assert combined["iteration_tokens"] == {"bounds": [1, 8], "counts": [7, 1]}


def test_data_parallel_engines_draw_unseeded_requests_apart(tiny_llama):
    """Issue 49's kind of silence: every engine started its seed counter at
    the same place, so request k of engine 0 and request k of engine 1
    sampled the same stream (two clients, one prompt, temperature 1: the
    same answer). Each rank now has seeds of its own; one rank stays
    reproducible."""
    from common.engine.parts import assemble_engine
    from tests.engine_helpers import run_all

    def sample(rank: int) -> list[int]:
        engine = assemble_engine(EngineConfig(device_memory_gb=2.0), loaded=tiny_llama,
                                 num_blocks=32, data_parallel_rank=rank)
        params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
        return run_all(engine, {"r": [1, 2, 3, 4]}, params)["r"].token_ids

    assert sample(0) == sample(0)
    assert sample(1) != sample(0)


# ------------------------------------------------- two engine processes
@pytest.fixture(scope="module")
def mp_engine():
    config = EngineConfig(dtype="float32", device="cpu", device_memory_gb=1.1,
                          enable_prefix_caching=True)
    engine = AsyncMPClient.start(EngineCoreSpec(config), data_parallel_size=2)
    yield engine
    engine.close()


def test_two_engine_processes_give_hf_greedy_tokens(mp_engine, embedded):
    prompts = [apply_chat_template(mp_engine.tokenizer, messages) for messages in PROMPTS]

    async def run(prompt_ids: list[int], k: int) -> list[int]:
        async for output in mp_engine.generate(f"greedy-{k}", prompt_ids,
                                               SamplingParams(temperature=0, max_tokens=24)):
            last = output
        return last.outputs[0].token_ids

    async def all_of_them():
        return await asyncio.gather(*[run(p, k) for k, p in enumerate(prompts)])

    tokens = asyncio.run(all_of_them())
    for prompt_ids, got in zip(prompts, tokens):
        assert got == hf_greedy(embedded.model, prompt_ids, 24)
    engines = mp_engine.snapshot()["engines"]
    assert [e["finished"].get("length", 0) + e["finished"].get("stop", 0) > 0
            for e in engines] == [True, True]  # both engines served some
    assert mp_engine.snapshot()["generation_tokens"] == sum(map(len, tokens))


def test_two_engines_are_pinned_to_a_core_each(mp_engine):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core here: the engines share it")
    cores = [os.sched_getaffinity(e.process.pid) for e in mp_engine.engines]
    assert all(len(c) == len(cores[0]) for c in cores) and not cores[0] & cores[1]


# ------------------------------------------------------- the server
def engine_pids(server) -> list[int]:
    return [int(pid) for pid in re.findall(r"engine core \d+: pid (\d+)",
                                           server.log_path.read_text())]


def stream_in_thread(url: str, body: dict, events: list) -> threading.Thread:
    """POST a streamed completion; append ("chunk", data) for each event."""
    def run() -> None:
        with requests.post(url + "/v1/completions", json={**body, "stream": True},
                           stream=True, timeout=600) as answer:
            for line in answer.iter_lines():
                if line.startswith(b"data: "):
                    events.append(("chunk", line[6:].decode()))
        events.append(("closed", None))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_health_and_a_400_answer_during_a_long_prefill(start_server):
    server = start_server("09", "--device-memory-gb", "1.2")
    events: list = []
    prompt = [(i * 7) % 5000 + 100 for i in range(7000)]  # 7,000 token ids, ~14 steps
    thread = stream_in_thread(server.url, {"model": "smollm2", "prompt": prompt,
                                           "max_tokens": 2}, events)
    wait_for(lambda: requests.get(server.url + "/stats", timeout=30).json()["running"] == 1,
             "the long prompt in the engine's batch")
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    events.append(("health", None))
    bad = requests.post(server.url + "/v1/completions", timeout=30,
                        json={"model": "smollm2", "prompt": "Hi", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    events.append(("bad request answered", None))
    thread.join(600)
    kinds = [kind for kind, _ in events]
    assert kinds.index("bad request answered") < kinds.index("chunk"), kinds
    assert "[DONE]" in [data for _, data in events]
    server.stop()


def test_a_client_gone_mid_stream_frees_its_blocks(start_server):
    server = start_server("09", "--device-memory-gb", "1.1")
    with requests.post(server.url + "/v1/completions", stream=True, timeout=120, json={
            "model": "smollm2", "prompt": "Once upon a time", "max_tokens": 2000,
            "ignore_eos": True, "stream": True}) as answer:
        lines = answer.iter_lines()  # held: a dropped generator closes the connection
        next(lines)
        wait_for(lambda: requests.get(server.url + "/stats").json()["kv_used_blocks"] > 0,
                 "the request's blocks in use")
    wait_for(lambda: requests.get(server.url + "/stats").json()["kv_used_blocks"] == 0,
             "the blocks freed once the client left")
    assert requests.get(server.url + "/stats").json()["finished"].get("abort") == 1
    server.stop()


def test_a_killed_engine_ends_the_streams_and_the_server_exits_1(start_server):
    server = start_server("09", "--device-memory-gb", "1.1", "--data-parallel-size", "2")
    pids = engine_pids(server)
    assert len(pids) == 2
    events: list = []
    thread = stream_in_thread(server.url, {"model": "smollm2", "prompt": "Once upon a time",
                                           "max_tokens": 2000, "ignore_eos": True}, events)
    wait_for(lambda: any(kind == "chunk" for kind, _ in events), "the first token")
    os.kill(pids[0], signal.SIGKILL)
    thread.join(120)
    assert not thread.is_alive(), "the stream hangs"
    last_chunks = [json.loads(data) for kind, data in events
                   if kind == "chunk" and data != "[DONE]"]
    assert last_chunks[-1]["error"]["code"] == "engine_dead"
    assert events[-2:] == [("chunk", "[DONE]"), ("closed", None)]
    try:
        health = requests.get(server.url + "/health", timeout=10)
        assert health.status_code == 503
    except requests.ConnectionError:
        pass  # already gone: also what vLLM does
    assert server.process.wait(60) == 1
    wait_for(lambda: not os.path.exists(f"/proc/{pids[1]}"), "the other engine gone too", 30)


def test_a_dead_engine_is_noticed_while_messages_keep_coming(monkeypatch):
    """Issue 49: the reader checked the engine processes only when no
    message came for POLL_MS. With another engine busy, messages always
    came, and a dead engine went unnoticed (its streams froze). A reader
    whose socket always has a message must still check, and die of it."""
    from common.engine import core_client
    client = AsyncMPClient.__new__(AsyncMPClient)
    client._closing = False

    class AlwaysAMessage:
        def poll(self, timeout_ms):
            return True

        def recv(self):
            return b""

    client._output_socket = AlwaysAMessage()
    monkeypatch.setattr(core_client, "decode", lambda raw: {})
    messages, died = [], threading.Event()
    client._on_message = messages.append

    def dead_engine():
        raise core_client.EngineDeadError("engine core 0 exited with status -9")

    client._check_processes = dead_engine
    client._die = lambda exc: (setattr(client, "_closing", True), died.set())
    reader = threading.Thread(target=client._read_outputs, daemon=True)
    reader.start()
    assert died.wait(30), "the dead engine was never noticed"
    assert messages  # it was busy all along
    client._closing = True


def gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie nobody reaps yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_an_engine_whose_api_server_is_killed_exits_at_once(start_server):
    """Its API server SIGKILLed while the engine computes a long answer (its
    outputs soon pile up unread): the engine process exits within seconds.
    Before, it checked its parent only when idle, and was still computing,
    then blocked in a send, minutes later."""
    server = start_server("09", "--device-memory-gb", "1.1")
    [pid] = engine_pids(server)
    with requests.post(server.url + "/v1/completions", stream=True, timeout=120, json={
            "model": "smollm2", "prompt": "Once upon a time", "max_tokens": 4000,
            "ignore_eos": True, "stream": True}) as answer:
        lines = answer.iter_lines()
        for _ in range(5):
            next(lines)  # the engine is computing
        server.process.kill()
        server.process.wait(30)
    wait_for(lambda: gone(pid), "the orphaned engine gone", timeout=15)


def test_an_engine_that_cannot_be_built_is_a_usage_error():
    started = subprocess.run(
        [sys.executable, str(ROOT / "09-scale-out" / "server.py"), "--dtype", "float32",
         "--tensor-parallel-size", "2"], capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert started.returncode == 2, started.stderr[-2000:]
    assert "must be divisible by tensor parallel size (2)" in started.stderr
