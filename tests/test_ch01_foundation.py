"""Chapter 01: the loader, the by-hand loop, the chat server over HTTP."""
import subprocess
import sys

import pytest
import requests
import torch

from common.autoregressive import eos_token_ids
from common.loader import ModelLoadError, apply_chat_template, load_model
from tests.conftest import PROMPTS, ROOT, hf_greedy, openai_client

pytestmark = pytest.mark.ch01


def test_embedded_model_loads_offline_with_its_chat_template(embedded):
    cfg = embedded.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert embedded.max_model_len == 8192
    ids = apply_chat_template(embedded.tokenizer, PROMPTS[0])
    text = embedded.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")


def test_dummy_model_builds_from_a_config():
    lm = load_model("tiny-llama", load_format="dummy", device="cpu")
    assert lm.model.config.num_hidden_layers == 2
    logits = lm.model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 49152) and torch.isfinite(logits).all()


def test_bad_model_name_gives_a_clear_error():
    with pytest.raises(ModelLoadError) as info:
        load_model("no-such-org/no-such-model", device="cpu")
    message = str(info.value)
    assert "no-such-org/no-such-model" in message and "smollm2" in message
    assert "--load-format dummy" in message


@pytest.mark.ex01
def test_the_loop_stops_at_max_new_tokens_or_eos(tiny_llama, impl):
    """max_new_tokens new tokens and "length", or up to the first EOS and "stop"."""
    model, prompt = tiny_llama.model, [1, 2, 3, 4]
    ids, reason = impl.generate_without_cache(model, prompt, 6, 0.0, set())
    assert len(ids) == 6 and reason == "length"
    first = ids[0]  # make the first greedy token an end-of-sequence token
    ids, reason = impl.generate_without_cache(model, prompt, 6, 0.0, {first})
    assert ids == [first] and reason == "stop"


@pytest.mark.ex01
def test_one_seeded_generator_draws_the_whole_answer(tiny_llama, impl):
    """At temperature 1 with a seed, the loop gives the answer of one CPU
    generator seeded once and handed to every step: a generator made anew
    at each step draws the same random number every time, and no generator
    at all does not replay."""
    model, prompt, seed, n = tiny_llama.model, [1, 2, 3, 4], 5, 8
    ids, reason = impl.generate_without_cache(model, prompt, n, 1.0, set(), seed=seed)
    assert reason == "length"
    generator = torch.Generator(device="cpu").manual_seed(seed)
    expected, tokens = [], list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([tokens])).logits[0, -1]
            expected.append(impl.sample_next_token(logits, 1.0, generator))
            tokens.append(expected[-1])
    assert ids == expected, (
        "with a seed, the answer should be that of one generator seeded once before the "
        f"loop and passed to every step: {ids} != {expected}")


@pytest.mark.ex01
@pytest.mark.parametrize("messages", PROMPTS)
def test_greedy_loop_by_hand_equals_hf_generate(embedded, messages, impl):
    """Greedy, the loop by hand gives exactly HF model.generate's tokens."""
    ids = apply_chat_template(embedded.tokenizer, messages)
    eos = eos_token_ids(embedded.model, embedded.tokenizer)
    ours, reason = impl.generate_without_cache(embedded.model, ids, 40, 0.0, eos)
    assert ours == hf_greedy(embedded.model, ids, 40)
    assert reason == ("stop" if ours[-1] in eos else "length")


@pytest.mark.ex01
def test_sample_next_token_greedy_seeded_and_temperature(impl):
    """Temperature 0 is the argmax; a seeded generator replays the same
    draws; a token with no probability is never drawn; a high temperature
    flattens the distribution."""
    logits = torch.tensor([1.0, 3.0, 2.0, float("-inf")])
    assert impl.sample_next_token(logits, 0.0) == 1

    def draws(temperature: float, seed: int, n: int = 400) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [impl.sample_next_token(logits, temperature, generator) for _ in range(n)]

    assert draws(1.0, 7) == draws(1.0, 7)
    assert 3 not in draws(1.0, 7) and 3 not in draws(5.0, 7)
    cold, hot = draws(0.2, 1), draws(5.0, 1)
    assert cold.count(1) > 390  # nearly greedy
    assert 100 < hot.count(1) < 250 and hot.count(0) > 60  # nearly uniform over 3


@pytest.fixture(scope="module")
def ch01(start_server):
    return start_server("01")


def test_ch01_over_http_with_the_openai_client(ch01):
    client = openai_client(ch01.url)
    assert client.models.list().data[0].id == "smollm2"
    reply = client.chat.completions.create(
        model="smollm2", messages=PROMPTS[0], max_tokens=20, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.prompt_tokens == 37
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    short = client.chat.completions.create(
        model="smollm2", messages=PROMPTS[1], max_tokens=5, temperature=0)
    assert short.usage.completion_tokens == 5 and short.choices[0].finish_reason == "length"


def assert_bad_input_rejected(url: str) -> None:
    """Malformed JSON, empty messages, negative max_tokens, loose types, a
    lone surrogate, a prompt too long, a field this chapter does not
    implement -> 400 + envelope; then the server still answers."""
    endpoint = url + "/v1/chat/completions"
    hi = [{"role": "user", "content": "hi"}]
    cases = [
        (dict(data="{not json", headers={"content-type": "application/json"}), None),
        (dict(json={"messages": []}), "messages"),
        (dict(json={"messages": hi, "max_tokens": -1}), "max_tokens"),
        (dict(json={"messages": hi, "temperature": "hot"}), "temperature"),
        (dict(json={"messages": hi, "max_tokens": "8"}), "max_tokens"),
        (dict(json={"messages": hi, "seed": 2 ** 64}), "seed"),
        (dict(data='{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
              headers={"content-type": "application/json"}), "messages.0.content"),
        (dict(json={"messages": [{"role": "user", "content": "hello " * 9000}]}), "messages"),
        (dict(json={"messages": hi, "stop": ["."]}), "stop"),  # not implemented here
        (dict(json={"messages": hi, "stream": True}), "stream"),  # chapter 06 streams
    ]
    for case, param in cases:
        response = requests.post(endpoint, timeout=60, **case)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error"
        assert error["param"] == param, error
    ok = requests.post(endpoint, json={"messages": PROMPTS[2], "max_tokens": 3}, timeout=120)
    assert ok.status_code == 200


def test_model_is_a_positional_or_a_flag_as_in_vllm_serve():
    from common.config import resolve_model_flags
    from common.entrypoints.cli_args import server_parser

    def model(*argv):
        parser = server_parser("test")
        args = parser.parse_args(list(argv))
        resolve_model_flags(parser, args)
        return args.model

    assert model() == "smollm2"
    assert model("gpt2") == model("--model", "gpt2") == "gpt2"
    assert model("gpt2", "--model", "gpt2") == "gpt2"
    with pytest.raises(SystemExit):
        model("gpt2", "--model", "Qwen/Qwen2.5-0.5B-Instruct")


def test_ch01_bad_input(ch01):
    assert_bad_input_rejected(ch01.url)


def test_the_server_refuses_a_later_chapters_flag_before_loading_the_model():
    """Chapter 01 has no blocks: `--block-size 8` is a usage error (exit 2)
    naming the chapter that adds it, not a flag silently ignored."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "01-concepts" / "server.py"), "--block-size", "8"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "error: --block-size is not implemented in chapter 01: chapter 04 adds it" \
        in result.stderr
