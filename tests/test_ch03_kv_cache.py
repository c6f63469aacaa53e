"""Chapter 03: our forward pass, the contiguous KV cache, the sampler."""
import time

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

from bench.loadtest import run_load
from common.autoregressive import generate_without_cache
from common.engine.kv_cache import KVCache
from common.layers.attention import AttentionMetadata
from common.layers.sampler import RequestSamplingState, Sampler, filter_logits
from common.loader import apply_chat_template
from common.memory import Card
from common.models import build_forward
from common.sampling_params import SamplingParams
from tests.bad_inputs import assert_rejected_on_one_connection
from tests.conftest import PROMPTS, hf_greedy
from tests.engine_helpers import greedy, make_engine, run_all

pytestmark = pytest.mark.ch03

TINY = dict(vocab_size=1000, max_position_embeddings=256)
CONFIGS = {
    "llama-gqa": LlamaConfig(hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                             num_attention_heads=6, num_key_value_heads=2, **TINY),
    "qwen2-bias": Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2,
                              tie_word_embeddings=False, **TINY),
    "gpt2": GPT2Config(vocab_size=1000, n_positions=256, n_embd=64, n_layer=2, n_head=4),
}


def our_logits(hf_model, token_ids: list[int], attention_ops=None) -> torch.Tensor:
    """One sequence's prefill through our forward and a paged cache."""
    num_tokens, block_size = len(token_ids), 16
    num_blocks = -(-num_tokens // block_size)
    cache = KVCache(Card(torch.device("cpu")), hf_model.config, num_blocks, block_size,
                    torch.float32)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens), query_start_loc=torch.tensor([0, num_tokens]),
        context_lens=torch.tensor([num_tokens]),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None, :],
        num_decodes=1 if num_tokens == 1 else 0, block_size=block_size)
    forward = build_forward(hf_model, attention_ops)
    hidden = forward.forward(torch.tensor(token_ids), torch.arange(num_tokens),
                             cache.kv_caches, meta)
    return forward.compute_logits(hidden)  # (num_tokens, vocab)


@pytest.mark.ex03
def test_store_then_attend_equals_plain_attention(impl):
    """Contiguous regions (one block of max_len slots per sequence): store
    the prompt's K/V, attend causally over it, then store and attend one
    decode token. Against attention written out with softmax, GQA included."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, max_len, lens = 4, 2, 8, 32, [5, 9]
    k_cache = torch.zeros(len(lens), max_len, num_kv_heads, head_dim)  # a region each
    v_cache = torch.zeros_like(k_cache)
    tables = torch.arange(len(lens), dtype=torch.int32)[:, None]  # (num_seqs, 1)
    scale = head_dim ** -0.5
    q, k, v = ([torch.randn(n, h, head_dim) for n in lens] for h in
               (num_heads, num_kv_heads, num_kv_heads))

    def plain(q_i, k_i, v_i, first_pos):  # (Tq, H, D), (Tk, H_kv, D)
        k_i = k_i.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v_i = v_i.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_i, k_i) * scale
        q_pos = torch.arange(first_pos, first_pos + q_i.shape[0])[:, None]
        scores = scores.masked_fill(torch.arange(k_i.shape[0])[None, :] > q_pos, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v_i)

    slots = torch.cat([torch.arange(n) + i * max_len for i, n in enumerate(lens)])
    impl.attention_ops.store_kvcache(torch.cat(k), torch.cat(v), k_cache, v_cache, slots)
    starts = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    out = impl.attention_ops.paged_prefill_attention(
        torch.cat(q), k_cache, v_cache, tables, starts, torch.tensor(lens, dtype=torch.int32),
        scale)
    expected = torch.cat([plain(q[i], k[i], v[i], 0) for i in range(len(lens))])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # One decode token per sequence, at position len.
    q1, k1, v1 = torch.randn(2, num_heads, head_dim), torch.randn(2, num_kv_heads, head_dim), \
        torch.randn(2, num_kv_heads, head_dim)
    impl.attention_ops.store_kvcache(k1, v1, k_cache, v_cache,
                                     torch.tensor([n + i * max_len for i, n in enumerate(lens)]))
    out = impl.attention_ops.paged_decode_attention(
        q1, k_cache, v_cache, tables, torch.tensor([n + 1 for n in lens], dtype=torch.int32),
        scale)
    expected = torch.cat([plain(q1[i:i + 1], torch.cat([k[i], k1[i:i + 1]]),
                                torch.cat([v[i], v1[i:i + 1]]), lens[i]) for i in range(2)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.ex03
@pytest.mark.parametrize("family", CONFIGS)
def test_forward_matches_hf_on_tiny_random_models(family, impl):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family], dtype=torch.float32).eval()
    if family == "qwen2-bias":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    ids = torch.randint(0, 1000, (37,)).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(our_logits(model, ids, impl.attention_ops), expected,
                               atol=1e-4, rtol=1e-4)


@pytest.mark.ex03
def test_forward_matches_hf_on_the_embedded_model(embedded, impl):
    ids = apply_chat_template(embedded.tokenizer, PROMPTS[1])
    with torch.no_grad():
        expected = embedded.model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(our_logits(embedded.model, ids, impl.attention_ops), expected,
                               atol=1e-3, rtol=1e-4)


@pytest.fixture(scope="module")
def ch03_engine(embedded, impl):
    return make_engine(embedded, policy="static", block_size=None, max_num_seqs=1, impl=impl)


@pytest.mark.ex03
def test_ch03_greedy_tokens_equal_hf_generate(embedded, ch03_engine):
    prompts = {str(i): apply_chat_template(embedded.tokenizer, m) for i, m in enumerate(PROMPTS)}
    done = run_all(ch03_engine, prompts, greedy(40))
    for request_id, ids in prompts.items():
        assert done[request_id].token_ids == hf_greedy(embedded.model, ids, 40)
    assert ch03_engine.block_manager.num_free_blocks == ch03_engine.block_manager.num_blocks


@pytest.mark.ex03
def test_decode_with_cache_equals_recompute_without_cache(embedded, ch03_engine):
    ids = apply_chat_template(embedded.tokenizer, PROMPTS[2])
    done = run_all(ch03_engine, {"x": ids}, greedy(32, ignore_eos=True))
    by_hand, _ = generate_without_cache(embedded.model, ids, 32, temperature=0.0)
    assert done["x"].token_ids == by_hand and len(by_hand) == 32


@pytest.mark.ex04
def test_region_reserved_released_on_finish_and_abort_and_requests_queue(embedded, impl):
    engine = make_engine(embedded, policy="static", block_size=None, num_blocks=1,
                         max_model_len=512, max_num_seqs=4, impl=impl)
    bm = engine.block_manager
    assert engine.block_size == 512
    ids = apply_chat_template(embedded.tokenizer, PROMPTS[0])
    engine.add_request("a", ids, greedy(8, ignore_eos=True))
    engine.add_request("b", ids, greedy(8, ignore_eos=True))
    engine.step()
    # One region for "a"; "b" queues instead of crashing.
    assert [s.request_id for s in engine.scheduler.running] == ["a"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["b"]
    usage = engine.kv_usage()
    assert usage.reserved_slots == 512 and usage.used_slots == len(ids)
    assert usage.waste_perc == pytest.approx(100 * (512 - len(ids)) / 512)
    engine.abort("a")
    assert bm.num_free_blocks == 1
    done = run_all(engine)
    assert list(done) == ["b"] and len(done["b"].token_ids) == 8
    assert bm.num_free_blocks == 1 and engine.stats.finished == {"abort": 1, "length": 1}


def test_sampling_seeded_reproducible_alone_or_in_a_batch(embedded):
    engine = make_engine(embedded, max_num_batched_tokens=256)
    ids = apply_chat_template(embedded.tokenizer, PROMPTS[1])
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = run_all(engine, {"s": ids}, seeded)["s"].token_ids
    others = {f"o{i}": apply_chat_template(embedded.tokenizer, PROMPTS[i % 3]) for i in range(3)}
    for rid, other in others.items():
        engine.add_request(rid, other, SamplingParams(temperature=1.0, max_tokens=12))
    in_batch = run_all(engine, {"s2": ids}, seeded)["s2"].token_ids
    assert alone == in_batch


def test_top_k_top_p_never_pick_outside_and_temperature_zero_is_greedy():
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    allowed_k = set(torch.topk(logits[0], 5).indices.tolist())
    probs = torch.softmax(logits[0], -1)
    order = torch.argsort(probs, descending=True)
    cumulative = torch.cumsum(probs[order], 0)
    nucleus = set(order[:int((cumulative < 0.5).sum()) + 1].tolist())
    sampler = Sampler()
    gen = torch.Generator().manual_seed(0)

    def state(**params) -> RequestSamplingState:
        return RequestSamplingState(SamplingParams(**params), [], 50, generator=gen)

    for _ in range(300):
        k = sampler(logits, [state(top_k=5)])[0].token_id
        p = sampler(logits, [state(top_p=0.5)])[0].token_id
        assert k in allowed_k and p in nucleus
    greedy_pick = sampler(logits, [state(temperature=0)])[0]
    assert greedy_pick.token_id == int(torch.argmax(logits))
    kept = filter_logits(logits[0], SamplingParams(top_k=3))
    assert int(torch.isfinite(kept).sum()) == 3


def recounted(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
              output: list[int], eos: list[int]) -> torch.Tensor:
    """The adjustments recomputed from the token lists, entry by entry: what
    RequestSamplingState's tensors, built once, must give at every step."""
    row = logits.clone()
    for token in set(prompt) | set(output):
        value = row[token]
        row[token] = value / params.repetition_penalty if value > 0 else \
            value * params.repetition_penalty
    for token in set(output):
        row[token] -= params.frequency_penalty * output.count(token)
        row[token] -= params.presence_penalty
    for token, bias in params.logit_bias.items():
        row[token] += bias
    if len(output) < params.min_tokens:
        row[eos + params.stop_token_ids] = float("-inf")
    return row


def test_sampling_tensors_built_once_match_a_recount_at_every_step():
    torch.manual_seed(0)
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5,
                            frequency_penalty=0.25, logit_bias={3: 5.0, 7: -100.0},
                            min_tokens=3, stop_token_ids=[11])
    prompt, output, eos = [1, 2, 3, 3, 9], [], [0]
    state = RequestSamplingState(params, prompt, 50, eos)
    for token in [4, 9, 4, 0, 12]:
        logits = torch.randn(50)
        assert torch.equal(state.adjust(logits), recounted(logits, params, prompt, output, eos))
        output.append(token)
        state.append(token)
    assert not state.banned_now and state.plain_greedy is False


def test_a_request_with_a_huge_logit_bias_costs_a_step_no_more_than_a_plain_one():
    """`logit_bias` on all 49,152 ids at n=16 cost ~100 ms of every step for
    everyone when its tensors were rebuilt each step (6.6x a plain row);
    built once, a row is one more vector add. Ratios in one run, best of 5."""
    vocab = 49152
    logits = torch.randn(16, vocab)
    plain = SamplingParams(temperature=1.0)
    biased = SamplingParams(temperature=1.0, logit_bias={i: 0.5 for i in range(vocab)})
    sampler = Sampler()

    def best_time(params: SamplingParams) -> float:
        states = [RequestSamplingState(params, [], vocab) for _ in range(16)]
        times = []
        for _ in range(5):
            start = time.perf_counter()
            sampler(logits, states)
            times.append(time.perf_counter() - start)
        return min(times)

    best_time(plain)  # warm up
    assert best_time(biased) < 2 * best_time(plain)


@pytest.fixture(scope="module")
def ch03_server(start_server):
    server = start_server("03", "--device-memory-gb", "1.1")
    yield server
    server.stop()


def test_ch03_load_test_on_the_demo_card_queues_instead_of_crashing(ch03_server):
    for clients in (2, 8):
        summary = run_load(ch03_server.url, clients, 1, max_tokens=8, timeout=300, deadline=600)
        assert summary["failed"] == 0 and summary["completed"] == clients
    stats = summary["server_stats"]
    assert stats["peak_running"] == 1 and stats["avg_kv_waste_perc"] > 95
    assert "KV waste" in ch03_server.log_path.read_text()


def test_ch03_hostile_input_is_a_400_naming_the_param(ch03_server):
    assert_rejected_on_one_connection(ch03_server.url)


def test_ch03_answers_from_the_engine_text_stop_strings_cut(ch03_server):
    body = {"messages": PROMPTS[0], "temperature": 0, "max_tokens": 20}
    whole = requests.post(ch03_server.url + "/v1/chat/completions", json=body,
                          timeout=300).json()["choices"][0]
    assert "Paris" in whole["message"]["content"]
    cut = requests.post(ch03_server.url + "/v1/chat/completions",
                        json={**body, "stop": ["Paris"]}, timeout=300).json()["choices"][0]
    assert cut["message"]["content"] == whole["message"]["content"].split("Paris")[0]
    assert cut["finish_reason"] == "stop"


def test_the_engine_logs_its_line_when_it_goes_idle(embedded, caplog):
    """The periodic line is also written when the last request finishes, so
    a burst shorter than the interval still gets one (on any machine)."""
    engine = make_engine(embedded, policy="static", block_size=None, max_num_seqs=1,
                         max_model_len=512, num_blocks=1)
    engine.stats_collector.log_interval_s = 1e9  # never on time: only the idle line
    with caplog.at_level("INFO", logger="llm-course"):
        run_all(engine, {"x": apply_chat_template(embedded.tokenizer, PROMPTS[0])}, greedy(4))
    lines = [r.getMessage() for r in caplog.records if "KV waste" in r.getMessage()]
    assert len(lines) == 1 and "Running: 0 reqs" in lines[0]
