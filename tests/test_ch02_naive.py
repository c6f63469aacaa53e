"""Chapter 02: the card, the naive server, the load test and the OOM demo."""
import gc
import http.client
import json
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import requests
import torch
from transformers import GPT2Config, LlamaConfig, Qwen2Config

from bench.loadtest import format_table, send_one, summarize
from common.memory import Card, MiB
from tests.conftest import PROMPTS, ROOT, openai_client, wait_for
from tests.test_ch01_foundation import assert_bad_input_rejected

pytestmark = pytest.mark.ch02
DEMO_CARD = "1.1"  # the Makefile's DEMO_CARD


def test_card_raises_cuda_shaped_oom_and_returns_freed_memory():
    card = Card(torch.device("cpu"), device_memory_gb=0.01, gpu_memory_utilization=1.0)
    block = card.allocate((1024, 1024), torch.float32, "a test block")  # 4 MiB
    assert card.allocated_bytes() == 4 * MiB
    with pytest.raises(torch.OutOfMemoryError) as info:
        card.allocate((2048, 1024), torch.float32, "too much")
    message = str(info.value)
    for part in ("simulated", "Tried to allocate 8.00 MiB", "total", "already allocated", "free"):
        assert part in message
    del block
    gc.collect()
    assert card.allocated_bytes() == 0 and card.peak_bytes() == 4 * MiB
    with card.reserve(8 * MiB, "a reservation"):
        assert card.allocated_bytes() == 8 * MiB
    assert card.allocated_bytes() == 0


@pytest.mark.ex02
def test_kv_bytes_per_token_of_the_embedded_model(embedded, impl):
    """2 (K and V) x 30 layers x 3 KV heads x 64 dims x 4 bytes (float32)."""
    assert impl.kv_bytes_per_token(embedded.model.config, torch.float32) == 46080
    assert impl.kv_bytes_per_token(embedded.model.config, torch.bfloat16) == 23040


@pytest.mark.ex02
def test_only_the_kv_heads_are_cached(impl):
    """With grouped-query attention the cache holds the KV heads, not the
    query heads: 9 query heads sharing 3 KV heads cache 3; a config whose
    KV heads are its query heads caches all of them."""
    gqa = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3)
    mha = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=9)
    assert impl.kv_cache_shape(gqa)[1] == 3, (
        "9 query heads share 3 KV heads: the cache holds 3 heads per layer")
    assert impl.kv_cache_shape(mha)[1] == 9


@pytest.mark.ex02
def test_head_dim_is_stated_or_hidden_size_over_query_heads(impl):
    """Without a stated head_dim (Qwen2's config has none), head_dim =
    hidden size / query heads (not KV heads), an int; a config that states
    head_dim wins over the division."""
    gqa = Qwen2Config(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3)
    explicit = LlamaConfig(hidden_size=1024, num_hidden_layers=2, num_attention_heads=16,
                           num_key_value_heads=8, head_dim=128)
    head_dim = impl.kv_cache_shape(gqa)[2]
    assert head_dim == 64, f"head_dim {head_dim}: 576 / 9 query heads = 64"
    assert type(head_dim) is int, f"head_dim {head_dim!r}: an int (a tensor's size), not a float"
    assert impl.kv_cache_shape(explicit)[2] == 128, "a stated head_dim wins (1024 / 16 = 64)"


@pytest.mark.ex02
def test_kv_bytes_count_k_and_v_in_every_layer_at_the_dtypes_size(impl):
    """2 (K and V) x layers x KV heads x head_dim x bytes per element of
    the cache's dtype, an int."""
    config = LlamaConfig(hidden_size=256, num_hidden_layers=5, num_attention_heads=8,
                         num_key_value_heads=2)  # head_dim 32
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2),
                        (torch.float64, 8), (torch.int8, 1)):
        got = impl.kv_bytes_per_token(config, dtype)
        assert got == 2 * 5 * 2 * 32 * size, (
            f"{dtype}: {got} bytes per token, expected 2 (K and V) x 5 layers x 2 KV heads "
            f"x 32 dims x {size} bytes = {2 * 5 * 2 * 32 * size}")
        assert type(got) is int


@pytest.mark.ex02
def test_kv_cache_shape_reads_every_config_naming(impl):
    """(layers, KV heads, head dim) from Llama names (with fewer KV heads:
    GQA), GPT-2 names, and a config that states its head_dim."""
    llama = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                        num_key_value_heads=3)
    gpt2 = GPT2Config(n_embd=768, n_layer=12, n_head=12)
    explicit = LlamaConfig(hidden_size=1024, num_hidden_layers=2, num_attention_heads=16,
                           num_key_value_heads=8, head_dim=128)
    assert impl.kv_cache_shape(llama) == (30, 3, 64)
    assert impl.kv_cache_shape(gpt2) == (12, 12, 64)
    assert impl.kv_cache_shape(explicit) == (2, 8, 128)
    # GPT-2 in float32: 2 x 12 x 12 x 64 x 4 = 72 KiB per token
    assert impl.kv_bytes_per_token(gpt2, torch.float32) == 73728
    # GPT-2's config.json as it is on disk, its own names only (GPT2Config
    # maps num_hidden_layers & co to them; a plain object does not)
    raw = SimpleNamespace(n_embd=768, n_layer=12, n_head=12, vocab_size=50257)
    assert impl.kv_cache_shape(raw) == (12, 12, 64), (
        "a config with only GPT-2's names: n_layer, n_head, n_embd")


@pytest.mark.ex02
def test_demo_card_holds_one_request_but_not_two(embedded, impl):
    """Chapter 02 reserves a static cache of max_model_len tokens per
    request: on the 1.1 GiB card, with the weights, one fits and two don't."""
    card = Card(torch.device("cpu"), float(DEMO_CARD))
    card.charge_weights(embedded.model)
    one_request = impl.static_cache_bytes(embedded.model.config, torch.float32, 8192)
    assert one_request == 46080 * 8192  # 360 MiB, whatever the prompt's length
    # in the dtype given, for the max_model_len given
    assert impl.static_cache_bytes(embedded.model.config, torch.bfloat16, 1000) == 23040 * 1000
    assert card.free_bytes() > one_request
    assert card.free_bytes() < 2 * one_request


def test_chapter_02_refuses_the_flags_of_later_chapters():
    """Every chapter's refusals, chapter 02's among them, are tested in
    tests/test_chapters.py from the one table; here the server itself."""
    from common.entrypoints.chapters import FLAG_CHAPTERS
    assert FLAG_CHAPTERS["--quantization"] == "08"


def test_the_server_refuses_quantization_before_loading_the_model():
    """`server.py --quantization int8` stops at once with exit code 2: it
    neither ignores the flag nor loads the model first (the card line that
    follows the load is never printed)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "02-minimal-pytorch-inference" / "server.py"),
         "--quantization", "int8"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert ("error: --quantization is not implemented in chapter 02: chapter 08 adds it"
            in result.stderr)
    assert "[ch02]" not in result.stdout


@pytest.fixture(scope="module")
def ch02(start_server):
    return start_server("02", "--device-memory-gb", DEMO_CARD)


def test_later_chapters_fields_are_refused_by_name(ch02):
    """`stream` is chapter 06's, `stop` the engine's (chapter 03), a grammar
    chapter 07's: each a 400 naming the chapter; `top_p` is chapter 02's own."""
    for field, value, adds in (("stream", True, "06"), ("stop", ["."], "03"),
                               ("response_format", {"type": "json_object"}, "07")):
        answer = requests.post(ch02.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, field: value},
            timeout=120)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == field and f"chapter {adds} adds it" in error["message"], error


def test_two_concurrent_clients_one_success_one_oom(ch02):
    """The second client arrives while the first holds its reservation: the
    first request is under way (its reservation is in the log) before the
    second is sent, so the outcome never depends on the machine's speed."""
    log = ch02.log_path
    reserved = log.read_text().count("reserved")
    results = []
    first = threading.Thread(target=lambda: results.append(send_one(
        ch02.url, 0, 64, False, 300, None)))
    first.start()
    wait_for(lambda: log.read_text().count("reserved") > reserved, "the first reservation")
    second = send_one(ch02.url, 1, 24, False, 300, None)
    first.join()
    summary = summarize(results + [second], 1.0)
    print(format_table({**summary, "server_stats": None}))
    assert summary["completed"] == 1 and summary["failed"] == 1
    assert results[0].ok and not second.ok
    error = summary["first_errors"][0]
    assert error.startswith("HTTP 500") and "out of memory" in error
    assert "Traceback" in log.read_text()
    assert ch02.alive()
    client = openai_client(ch02.url)
    reply = client.chat.completions.create(model="smollm2", messages=PROMPTS[0],
                                           max_tokens=12, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens <= 12


def test_ch02_bad_input(ch02):
    assert_bad_input_rejected(ch02.url)


def test_a_temperature_below_sampling_eps_is_greedy(ch02):
    """1e-300 would divide the logits into inf and NaN: below vLLM's 1e-5 it
    samples greedily, as temperature 0 does."""
    client = openai_client(ch02.url)
    answers = [client.chat.completions.create(model="smollm2", messages=PROMPTS[0],
                                              max_tokens=8, temperature=t, seed=1)
               for t in (0.0, 1e-300, 5e-324)]
    assert len({a.choices[0].message.content for a in answers}) == 1


def test_a_prompt_that_can_never_fit_the_card_is_a_400(ch02):
    """The activation estimate grows with the prompt's square: past ~550
    tokens no request fits the demo card even alone. Refused at admission
    (400, `messages`) instead of a 500 out-of-memory on an idle server."""
    long_prompt = [{"role": "user", "content": "the sea is blue. " * 150}]  # ~600 tokens
    response = requests.post(ch02.url + "/v1/chat/completions",
                             json={"messages": long_prompt, "max_tokens": 4}, timeout=300)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "can never" in error["message"]
    short = requests.post(ch02.url + "/v1/chat/completions",
                          json={"messages": PROMPTS[0], "max_tokens": 4}, timeout=300)
    assert short.status_code == 200


def test_a_client_that_hangs_up_gives_its_reservation_back(ch02):
    """A client asks for 4,000 tokens, then hangs up once its reservation is
    in the log: `generate` stops at the next disconnect check (a
    StoppingCriteria), the reservation is released, and the next request
    is served instead of getting the card's out-of-memory for minutes."""
    log = ch02.log_path
    reserved, done = log.read_text().count("reserved"), log.read_text().count("request done")
    body = json.dumps({"messages": PROMPTS[0], "max_tokens": 4000, "ignore_eos": True})
    conn = http.client.HTTPConnection(*ch02.url.split("//")[1].split(":"), timeout=60)
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    wait_for(lambda: log.read_text().count("reserved") > reserved, "the reservation")
    conn.close()  # the client hangs up
    wait_for(lambda: log.read_text().count("request done") > done, "generate to stop",
             timeout=60)
    assert "client disconnected: generation stopped" in log.read_text()
    reply = requests.post(ch02.url + "/v1/chat/completions",
                          json={"messages": PROMPTS[0], "max_tokens": 4}, timeout=300)
    assert reply.status_code == 200, reply.text
