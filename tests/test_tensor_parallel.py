"""Chapter 08: tensor parallelism (`--tensor-parallel-size N`) on the CPU, gloo.

Equivalence first: greedy float32 tokens at TP=2 (tiny dummy Llama, 4 heads,
2 KV heads) and TP=3 (the embedded SmolLM2: 9 heads, 3 KV heads) are those
of TP=1 and of HF `generate`. Then the refusals (2 ranks for 9 heads,
GPT-2, quantization), the card (N cards hold more than N times the blocks),
and a rank that dies: the engine loop stops with a clear error instead of
hanging. The worker processes are real (spawned, gloo over localhost).

One tensor-parallel engine per process at a time (one process group): the
TP=3 test runs and closes its engine before the module's TP=2 engine starts,
and the test that kills a rank comes last.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from transformers import GPT2Config

from common.config import ConfigError, EngineConfig
from common.engine.async_llm import AsyncLLM, EngineDeadError
from common.engine.llm_engine import LLMEngine
from common.engine.parts import assemble_engine
from common.worker.worker import RankDiedError
from common.layers.parallel import vocab_shard
from common.models import check_tensor_parallel
from common.loader import apply_chat_template
from common.sampling_params import RequestOutputKind
from tests.conftest import PROMPTS, ROOT, hf_greedy
from tests.engine_helpers import greedy, make_engine, run_all

pytestmark = pytest.mark.ch08
HANG_GUARD_S = 60.0  # bounds a failure only; no assertion on time


def tp_engine(model: str, tp: int, num_blocks: int | None = None, **config) -> LLMEngine:
    """An engine that loads its own model (rank 0 shards it in place)."""
    load_format = "dummy" if model == "tiny-llama" else "auto"
    return assemble_engine(EngineConfig(model=model, load_format=load_format, dtype="float32",
                                  device="cpu", tensor_parallel_size=tp, **config),
                     num_blocks=num_blocks)


@pytest.fixture(scope="module")
def tiny_tp2():
    """TP=2 on the tiny dummy Llama, sized from a small card (every rank
    builds the same random weights from the seed). The last test kills it."""
    engine = tp_engine("tiny-llama", 2, device_memory_gb=0.05, max_num_batched_tokens=64)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompts(embedded):
    return [apply_chat_template(embedded.tokenizer, m) for m in PROMPTS]


def test_tp3_embedded_gives_the_tokens_of_tp1_and_hf(embedded, prompts):
    """Each rank runs 3 query heads and 1 KV head; 61 all-reduces a step."""
    engine = tp_engine("smollm2", 3, num_blocks=64)
    try:
        model = engine.worker.model_runner.model
        assert (model.num_heads, model.num_kv_heads) == (3, 1)
        assert engine.worker.kv_cache.kv_caches[0][0].shape == (64, 16, 1, 64)
        three = run_all(engine, {str(i): p for i, p in enumerate(prompts)}, greedy(16))
        one = run_all(make_engine(embedded, num_blocks=64),
                      {str(i): p for i, p in enumerate(prompts)}, greedy(16))
        comm, stats = engine.worker.tp.stats, engine.stats
    finally:
        engine.close()
    for i, prompt in enumerate(prompts):
        assert three[str(i)].token_ids == one[str(i)].token_ids
        assert three[str(i)].token_ids == hf_greedy(embedded.model, prompt, 16)
    # Every token fed goes through 2 all-reduces per layer + the embedding's:
    # hidden (576) x 4 bytes each. The last sampled token of each request is not fed.
    tokens_fed = stats.prompt_tokens + stats.generation_tokens - len(prompts)
    assert comm.all_reduce_bytes == tokens_fed * 576 * 4 * (2 * 30 + 1)


def test_tp2_is_refused_for_9_heads_and_3_kv_heads(embedded):
    with pytest.raises(ConfigError) as info:
        assemble_engine(EngineConfig(tensor_parallel_size=2), loaded=embedded)
    message = str(info.value)
    assert "Total number of attention heads (9) must be divisible by tensor parallel " \
           "size (2)" in message
    assert "Total number of key-value heads (3)" in message
    assert mp.active_children() == []  # refused before any rank started
    check_tensor_parallel(embedded.model.config, 3)  # 3 divides both: accepted


def test_gpt2_and_quantization_are_refused_with_tp(embedded):
    with pytest.raises(ConfigError, match="tensor parallelism covers the Llama family"):
        check_tensor_parallel(GPT2Config(n_head=4), 2)
    with pytest.raises(ConfigError, match="not combined in this course"):
        check_tensor_parallel(embedded.model.config, 3, quantization="int8")
    check_tensor_parallel(GPT2Config(), 1)  # one rank: anything goes


def test_a_server_given_a_bad_tp_exits_with_the_message():
    server = ROOT / "08-levers-and-the-real-vllm" / "server.py"
    done = subprocess.run([sys.executable, str(server), "--tensor-parallel-size", "2",
                           "--dtype", "float32", "--device", "cpu"],
                          capture_output=True, text=True, timeout=HANG_GUARD_S * 3,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2  # argparse's usage error
    assert "Total number of attention heads (9) must be divisible" in done.stderr


def test_the_vocabulary_split_pads_the_last_shard():
    weight = torch.arange(10.0).repeat(2, 1).T  # (vocab 10, hidden 2)
    shards = [vocab_shard(weight, rank, 3) for rank in range(3)]
    assert [s.shape[0] for s in shards] == [4, 4, 4]
    assert torch.equal(torch.cat(shards)[:10], weight)
    assert shards[2][2:].abs().sum() == 0  # the padding rows


def test_tp2_tiny_llama_gives_the_tokens_of_tp1_and_hf(tiny_llama, tiny_tp2):
    ids = {str(i): [1 + (7 * i + j) % 500 for j in range(5 + 3 * i)] for i in range(3)}
    one = run_all(make_engine(tiny_llama, num_blocks=64), ids, greedy(20))
    two = run_all(tiny_tp2, ids, greedy(20))
    for request_id, prompt in ids.items():
        assert two[request_id].token_ids == one[request_id].token_ids
        assert two[request_id].token_ids == hf_greedy(tiny_llama.model, prompt, 20)


def test_n_cards_hold_more_than_n_times_the_blocks(tiny_llama, tiny_tp2):
    """The same card per rank; each rank stores half the KV heads and half
    the weights, so two cards hold more than twice the blocks of one."""
    one = make_engine(tiny_llama, device_memory_gb=0.05, max_num_batched_tokens=64)
    assert tiny_tp2.worker.kv_cache.num_kv_heads == 1 and one.worker.kv_cache.num_kv_heads == 2
    assert tiny_tp2.block_manager.num_blocks > 2 * one.block_manager.num_blocks
    assert tiny_tp2.worker.weight_bytes < one.worker.weight_bytes


def test_a_dead_rank_stops_the_engine_loop_with_a_clear_error(tiny_tp2):
    """Kill rank 1 mid-request: the request gets EngineDeadError, the loop
    dies with RankDiedError naming the rank (a server answers 503 and
    exits 1). Runs last: it breaks the module's TP=2 engine."""
    engine = AsyncLLM(tiny_tp2)
    worker = tiny_tp2.workers.processes[0]

    params = greedy(1000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def request_until_the_kill():
        outputs = 0
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("r", [1, 2, 3, 4, 5], params):
                outputs += 1
                if outputs == 1:
                    os.kill(worker.pid, signal.SIGKILL)
        return outputs

    asyncio.run(asyncio.wait_for(request_until_the_kill(), HANG_GUARD_S))
    assert engine.died.wait(HANG_GUARD_S)
    assert isinstance(engine.dead, RankDiedError)
    assert "rank 1" in str(engine.dead) and "died" in str(engine.dead)
    assert not engine.alive
    engine.close()
    assert not any(p.is_alive() for p in tiny_tp2.workers.processes)
