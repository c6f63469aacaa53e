"""Chapter 06: the OpenAI-compatible server, over real HTTP.

`server` is `06-openai-server/server.py` started as a learner would (with
an API key), then `09-scale-out/server.py --data-parallel-size 2` (the
same suite, unchanged, on two engine processes); `local` is the same app run in this process on the shared
model, so a test can hold the engine's step lock or make a step fail.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import select
import signal
import socket
import threading
import time

import openai
import pytest
import requests
import torch

from common.engine.async_llm import AsyncLLM
from common.entrypoints.api_server import build_app
from common.entrypoints.middleware import RateLimit
from common.entrypoints.launcher import exit_code, make_server
from common.metrics.stats import FinishedRequestStats, IterationStats
from common.entrypoints.metrics import Metrics
from common.loader import apply_chat_template
from tests.bad_inputs import assert_rejected_on_one_connection, bad_amid_good
from tests.conftest import PROMPTS, free_port, hf_greedy, openai_client, wait_for
from tests.engine_helpers import fail_rows_seeded, make_engine

pytestmark = pytest.mark.ch06

KEY = "sk-course"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


# The suite runs twice: on chapter 06, and unchanged on chapter 09 with two
# engine processes behind the API server (common/engine/core_client.py).
SERVERS = {"ch06": ("06", "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint"),
           "ch09-dp2": ("09", "--data-parallel-size", "2")}


@pytest.fixture(scope="module", params=list(SERVERS))
def server(start_server, request):
    chapter, *extra = SERVERS[request.param]
    server = start_server(chapter, "--device-memory-gb", "1.1", "--api-key", KEY,
                          "--served-model-name", "course-model", *extra)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url, api_key=KEY)


@pytest.fixture(scope="module")
def stream_client(server):
    """For streamed text completions only: the SDK's `CompletionChoice` types
    `finish_reason` as never null, but OpenAI (and vLLM) send null in every
    chunk but the last, so strict validation would reject OpenAI itself.
    The wire format is checked with raw requests below."""
    return openai_client(server.url, strict=False, api_key=KEY)


def post(server, path: str, body, headers=AUTH, **kw) -> requests.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(server.url + path, data=data, timeout=120,
                         headers={"content-type": "application/json", **headers}, **kw)


def sse_events(response: requests.Response) -> list[str]:
    """The `data:` payloads of an SSE body, checking the blank-line framing."""
    body = response.text
    assert body.endswith("\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events[:3]
    return [e[len("data: "):] for e in events]


def chat(client, **kw):
    kw = {"model": "course-model", "messages": CHAT, "temperature": 0, "max_tokens": 16, **kw}
    return client.chat.completions.create(**kw)


# --------------------------------------------------------------- endpoints
def test_models_health_version_tokenize_detokenize(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["course-model"]
    assert requests.get(server.url + "/v1/models", headers=AUTH).json()["data"][0][
        "max_model_len"] == 8192
    assert requests.get(server.url + "/health").status_code == 200
    assert requests.get(server.url + "/version").json()["version"]
    tokens = post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) == 2 and tokens["max_model_len"] == 8192
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {
        "prompt": "Hello world"}
    chat_tokens = post(server, "/tokenize", {"messages": CHAT}).json()
    assert chat_tokens["count"] > tokens["count"]
    strs = post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert strs.json()["token_strs"] == ["Hello", "Ġworld"]  # the tokenizer's own spelling
    assert "token_strs" not in tokens  # only when asked, as vLLM


def test_chat_equals_hf_generate(server, client, embedded):
    prompt_ids = apply_chat_template(embedded.tokenizer, PROMPTS[1])
    reference = embedded.tokenizer.decode(hf_greedy(embedded.model, prompt_ids, 24),
                                          skip_special_tokens=True)
    answer = chat(client, messages=PROMPTS[1], max_tokens=24)
    assert answer.choices[0].message.content == reference
    assert answer.usage.prompt_tokens == len(prompt_ids)


def test_completions_equal_hf_generate(client, embedded):
    prompt = "The three primary colors are"
    ids = embedded.tokenizer(prompt)["input_ids"]
    reference = embedded.tokenizer.decode(hf_greedy(embedded.model, ids, 12),
                                          skip_special_tokens=True)
    answer = client.completions.create(model="course-model", prompt=prompt, max_tokens=12,
                                       temperature=0)
    assert answer.choices[0].text == reference and answer.object == "text_completion"
    by_ids = client.completions.create(model="course-model", prompt=ids, max_tokens=12,
                                       temperature=0)
    assert by_ids.choices[0].text == reference


def test_metrics_have_vllm_names(server, client):
    chat(client, max_tokens=4)
    text = requests.get(server.url + "/metrics").text
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_sum"]:
        assert name in text, name
    assert 'finished_reason="length",model_name="course-model"' in text


# The metrics that vLLM's Grafana dashboard reads, panel by panel
# (examples/observability/prometheus_grafana/grafana.json in vLLM's repository).
GRAFANA_PANELS = {
    "E2E Request Latency": ["vllm:e2e_request_latency_seconds_bucket"],
    "Token Throughput": ["vllm:prompt_tokens_total", "vllm:generation_tokens_total"],
    "Inter Token Latency": ["vllm:inter_token_latency_seconds_bucket"],
    "Scheduler State": ["vllm:num_requests_running", "vllm:num_requests_waiting"],
    "Time To First Token Latency": ["vllm:time_to_first_token_seconds_bucket"],
    "Cache Utilization": ["vllm:kv_cache_usage_perc"],
    "Request Prompt Length": ["vllm:request_prompt_tokens_bucket"],
    "Request Generation Length": ["vllm:request_generation_tokens_bucket"],
    "Finish Reason": ["vllm:request_success_total"],
    "Queue Time": ["vllm:request_queue_time_seconds_sum"],
    "Requests Prefill and Decode Time": ["vllm:request_prefill_time_seconds_sum",
                                         "vllm:request_decode_time_seconds_sum"],
    "Max Generation Token in Sequence Group": ["vllm:request_max_num_generation_tokens_sum"],
}


def scrape_server(server) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    text = requests.get(server.url + "/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_every_grafana_panel_of_vllm_has_data(server, client):
    chat(client, max_tokens=4)
    names = {key.split("{")[0] for key in scrape_server(server)}
    for panel, metrics in GRAFANA_PANELS.items():
        assert set(metrics) <= names, panel
    for name in ["vllm:iteration_tokens_total_bucket", "vllm:cache_config_info",
                 "vllm:request_params_n_bucket", "vllm:request_params_max_tokens_bucket",
                 "vllm:request_inference_time_seconds_bucket",
                 "vllm:request_time_per_output_token_seconds_bucket"]:
        assert name in names, name


def test_request_metrics_mean_what_vllms_mean(server):
    """One request with n=2: request_params_n observes 2 once, the most
    tokens one choice generated, each choice's prompt and generated tokens;
    a repeated prompt counts its tokens as prefix-cache queries, and its
    full blocks but the last token's as hits (tokens, as vLLM, not blocks).
    vllm:prompt_tokens counts every prompt token received, cached or not,
    and prompt_tokens_by_source splits them: computed, or a cache hit."""
    label = '{model_name="course-model"}'
    before = scrape_server(server)
    prompt = f"Count the sheep: {time.time_ns()} " + "sheep " * 40  # not cached yet
    body = {"prompt": prompt, "max_tokens": 9, "n": 2, "temperature": 1.0, "seed": 3,
            "return_token_ids": True}
    answer = post(server, "/v1/completions", body).json()
    after = scrape_server(server)

    def grew(name: str) -> float:
        return after[name + label] - before.get(name + label, 0.0)

    generated = [len(c["token_ids"]) for c in answer["choices"]]
    num_prompt = answer["usage"]["prompt_tokens"]
    assert grew("vllm:request_params_n_count") == 1 and grew("vllm:request_params_n_sum") == 2
    assert grew("vllm:request_max_num_generation_tokens_sum") == max(generated)
    assert grew("vllm:request_generation_tokens_sum") == sum(generated)
    assert grew("vllm:request_prompt_tokens_sum") == 2 * num_prompt
    assert grew("vllm:request_params_max_tokens_sum") == 18
    assert grew("vllm:request_prefill_time_seconds_count") == 2
    # The two choices share the prompt: the second hits the first's blocks
    # only if it was admitted a step later (once they were computed).
    full_blocks = (num_prompt - 1) // 16 * 16  # tokens; the last one is always computed
    assert grew("vllm:prefix_cache_queries_total") == 2 * num_prompt
    assert grew("vllm:prefix_cache_hits_total") in (0, full_blocks)
    post(server, "/v1/completions", {**body, "n": 1})
    again = scrape_server(server)
    assert again["vllm:prefix_cache_queries_total" + label] - after[
        "vllm:prefix_cache_queries_total" + label] == num_prompt
    assert again["vllm:prefix_cache_hits_total" + label] - after[
        "vllm:prefix_cache_hits_total" + label] == full_blocks
    source = 'vllm:prompt_tokens_by_source_total{model_name="course-model",source="%s"}'
    received = {"vllm:prompt_tokens_total" + label: num_prompt,
                "vllm:prompt_tokens_cached_total" + label: full_blocks,
                source % "local_cache_hit": full_blocks,
                source % "local_compute": num_prompt - full_blocks,
                source % "external_kv_transfer": 0}
    assert {name: again[name] - after[name] for name in received} == received
    assert grew("vllm:prompt_tokens_total") == 2 * num_prompt  # the n=2 request: both
    assert grew("vllm:request_num_preemptions_count") == 2
    info = [k for k in again if k.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and 'block_size="16"' in info[0]
    assert 'enable_prefix_caching="True"' in info[0]


# --------------------------------------------------------------- streaming
def test_chat_stream_wire_format_and_order(server):
    response = post(server, "/v1/chat/completions", {
        "model": "course-model", "messages": CHAT, "temperature": 0, "max_tokens": 8,
        "stream": True, "stream_options": {"include_usage": True}})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0] is chunks[-2]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    contents = [c["choices"][0]["delta"]["content"] for c in chunks[1:-2]]
    assert all(contents)


def test_stream_text_equals_non_stream_text(client, stream_client):
    whole = chat(client, max_tokens=24).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, max_tokens=24,
                                                                      stream=True))
    assert streamed == whole
    whole = client.completions.create(model="course-model", prompt="Once upon a time",
                                      max_tokens=20, temperature=0).choices[0].text
    streamed = "".join(c.choices[0].text for c in stream_client.completions.create(
        model="course-model", prompt="Once upon a time", max_tokens=20, temperature=0,
        stream=True))
    assert streamed == whole


def test_include_usage_on_completions(server, stream_client):
    chunks = list(stream_client.completions.create(
        model="course-model", prompt="Hello", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"
    events = sse_events(post(server, "/v1/completions", {
        "prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": True}))
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [
        "length"]


# -------------------------------------------------------------- parameters
def test_n_choices(client):
    answer = chat(client, n=2, temperature=0.8, seed=3, max_tokens=8,
                  extra_body={"ignore_eos": True})
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.usage.completion_tokens == 2 * 8
    chunks = list(chat(client, n=2, max_tokens=6, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    greedy = chat(client, max_tokens=6).choices[0].message.content
    assert texts == {0: greedy, 1: greedy}


def test_stop_strings_across_token_boundaries_never_leak(client, embedded):
    full = chat(client, max_tokens=16).choices[0].message.content  # "The capital of France is Paris."
    ids = embedded.tokenizer(full, add_special_tokens=False)["input_ids"]
    boundary = len(embedded.tokenizer.decode(ids[:2]))  # the end of the second token
    stop = full[boundary - 2:boundary + 2]  # two characters each side of it
    expected = full[:full.index(stop)]
    answer = chat(client, max_tokens=16, stop=[stop, "zzz"])
    assert answer.choices[0].message.content == expected
    assert answer.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(
        client, max_tokens=16, stop=stop, stream=True))
    assert streamed == expected
    text = client.completions.create(model="course-model", prompt="One, two, three,",
                                     max_tokens=16, temperature=0, stop=[","]).choices[0].text
    assert "," not in text


def test_seed_reproducibility(client):
    def sample(seed):
        return chat(client, temperature=1.0, seed=seed, max_tokens=16).choices[0].message.content
    assert sample(11) == sample(11)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_logprobs(client):
    answer = chat(client, max_tokens=5, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy
        assert bytes(entry.bytes).decode() == entry.token
    assert "".join(e.token for e in content) == answer.choices[0].message.content
    text = client.completions.create(model="course-model", prompt="The sky is", max_tokens=4,
                                     temperature=0, logprobs=2).choices[0]
    assert len(text.logprobs.tokens) == 4 and len(text.logprobs.top_logprobs[0]) == 2
    assert text.logprobs.text_offset[0] == 0 and "".join(text.logprobs.tokens) == text.text


def test_completion_logprobs_offsets_and_the_sampled_token(server):
    """text_offset counts the tokens' own text, also in a stream whose stop
    string holds text back; top_logprobs always hold the sampled token."""
    body = {"model": "course-model", "prompt": "The three primary colors are", "max_tokens": 6,
            "temperature": 0, "logprobs": 0, "stop": ["\n\n"]}
    whole = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    chunks = [json.loads(e) for e in sse_events(post(server, "/v1/completions",
                                                     {**body, "stream": True}))[:-1]]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    offsets = [o for lp in streamed if lp for o in lp["text_offset"]]
    assert offsets == whole["text_offset"]
    assert offsets == [sum(map(len, whole["tokens"][:k])) for k in range(len(whole["tokens"]))]
    assert [list(top) for top in whole["top_logprobs"]] == [[t] for t in whole["tokens"]]
    sampled = post(server, "/v1/completions", {**body, "temperature": 1.5, "logprobs": 1,
                                               "seed": 3}).json()["choices"][0]["logprobs"]
    for token, top in zip(sampled["tokens"], sampled["top_logprobs"]):
        assert token in top and len(top) <= 2


def test_vllm_extras_and_unknown_fields(server):
    response = post(server, "/v1/chat/completions", {
        "model": "course-model", "messages": CHAT, "max_completion_tokens": 12,
        "temperature": 0.7, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
        "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_tokens": 12,
        "ignore_eos": True, "stop_token_ids": [], "user": "learner", "seed": 1,
        "some_future_field": {"x": 1}})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 12


def test_return_token_ids_as_vllm_sends_them(server, client, embedded):
    """vLLM's `return_token_ids`: the prompt's and the answer's ids beside the
    text, the answer's being HF's greedy tokens; absent unless asked for."""
    prompt_ids = apply_chat_template(embedded.tokenizer, CHAT)
    reference = hf_greedy(embedded.model, prompt_ids, 8)
    answer = chat(client, messages=CHAT, max_tokens=8, extra_body={"return_token_ids": True})
    assert answer.prompt_token_ids == prompt_ids
    assert answer.choices[0].token_ids == reference
    assert answer.system_fingerprint.startswith("llm-course-")
    plain = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain
    ids = [504, 1296, 3003, 4683, 359]  # "The three primary colors are"
    text = post(server, "/v1/completions", {"prompt": [ids, ids[:3]], "max_tokens": 4, "n": 2,
                                            "temperature": 0, "return_token_ids": True}).json()
    assert [c["prompt_token_ids"] for c in text["choices"]] == [ids, ids, ids[:3], ids[:3]]
    assert all(len(c["token_ids"]) == 4 for c in text["choices"])
    stream = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8,
                                                   "temperature": 0, "stream": True,
                                                   "return_token_ids": True}, stream=True)
    chunks = [json.loads(line[6:]) for line in stream.iter_lines(decode_unicode=True)
              if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert [i for c in chunks for i in c["choices"][0].get("token_ids", [])] == reference


def test_a_temperature_below_sampling_eps_is_greedy(server, client):
    """vLLM's rule: below 1e-5 a temperature means greedy (1e-300 would turn
    the logits into inf and NaN), whole answers and streams alike."""
    greedy = chat(client, max_tokens=8).choices[0].message.content
    for tiny in (1e-300, 5e-324):
        assert chat(client, max_tokens=8, temperature=tiny).choices[0].message.content == greedy
        stream = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8,
                                                       "temperature": tiny, "stream": True})
        events = sse_events(stream)
        assert stream.status_code == 200 and not any('"error"' in e for e in events)


# ------------------------------------------------------------------ errors
def assert_error(response: requests.Response, status: int, param: str | None = "any") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param != "any":
        assert error["param"] == param
    return error


def test_bad_input_gets_400_with_param(server):
    assert_error(post(server, "/v1/chat/completions", {"messages": CHAT, "temperature": 9}),
                 400, "temperature")
    assert_error(post(server, "/v1/chat/completions", {"messages": CHAT, "n": "two"}), 400, "n")
    assert_error(post(server, "/v1/chat/completions", b'{"messages": [}'), 400, None)
    assert_error(post(server, "/v1/chat/completions", {"messages": []}), 400, "messages")
    assert_error(post(server, "/v1/completions", {"prompt": ""}), 400, "prompt")
    assert_error(post(server, "/v1/completions", {"prompt": []}), 400, "prompt")
    error = assert_error(post(server, "/v1/chat/completions",
                              {"messages": CHAT, "max_tokens": 9000}), 400, "messages")
    assert "maximum context length is 8192 tokens" in error["message"]
    assert error["code"] == "context_length_exceeded"
    assert_error(post(server, "/v1/chat/completions",
                      {"messages": CHAT, "top_logprobs": 2}), 400, "top_logprobs")
    for body in (b"", b"[1, 2]"):  # not an object: say so, not "Invalid value for 'None'"
        assert "must be a JSON object" in assert_error(
            post(server, "/v1/chat/completions", body), 400, None)["message"]
    assert "finite" in assert_error(post(server, "/v1/chat/completions", '{"messages": '
                                         '[{"role": "user", "content": "Hi"}], "temperature": '
                                         'NaN}'), 400, "temperature")["message"]
    for message in ({"role": "user"}, {"role": "user", "content": []}):  # OpenAI: a 400
        assert_error(post(server, "/v1/chat/completions", {"messages": [message]}), 400,
                     "messages.0.content")
    for key in ("\u00b2", "7" * 4301, "-1", "1.5"):  # "²".isdigit() is true; int() refuses it
        assert_error(post(server, "/v1/chat/completions",
                          {"messages": CHAT, "logit_bias": {key: 1}}), 400, "logit_bias")
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert_error(post(server, "/v1/chat/completions", {"messages": CHAT, "tools": [tool]}),
                 400, "tools")
    assert_error(post(server, "/v1/chat/completions", {
        "messages": CHAT, "response_format": {"type": "xml"}}), 400, "response_format.type")


def test_vllm_fields_it_does_not_implement_are_refused_not_ignored(server):
    """Each vLLM extra this server does not implement is a 400 naming it when
    set (beam search on chat: it runs on /v1/completions); left at its
    default it passes, as a client library would send it."""
    refused = [("/v1/chat/completions", {"use_beam_search": True}, "use_beam_search")]
    for path, extra, param in refused:
        base = {"messages": CHAT} if path != "/v1/completions" else {"prompt": "Hi"}
        error = assert_error(post(server, path, {**base, "max_tokens": 2, **extra}), 400)
        assert param in (error["param"] or ""), (path, extra, error)
    defaults = {"prompt_logprobs": None, "use_beam_search": False, "echo": False,
                "add_generation_prompt": True, "continue_final_message": False,
                "structured_outputs": None}
    ok = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **defaults})
    assert ok.status_code == 200, ok.text


def test_logprobs_bounds_and_logit_bias_keys_as_vllm_words_them(server):
    """-1 asks for the whole vocabulary: refused beyond vLLM's default
    `--max-logprobs` (20), as vLLM refuses it; below -1 is out of bounds;
    every bad logit_bias key is named at once."""
    chat_lp = {"messages": CHAT, "max_tokens": 1, "logprobs": True}
    cases = [
        ("/v1/chat/completions", {**chat_lp, "top_logprobs": -1}, "top_logprobs",
         "Requested sample logprobs of 49152, which is greater than max allowed: 20"),
        ("/v1/chat/completions", {**chat_lp, "top_logprobs": 21}, "top_logprobs",
         "Requested sample logprobs of 21, which is greater than max allowed: 20"),
        ("/v1/chat/completions", {**chat_lp, "top_logprobs": -2}, "top_logprobs",
         "`top_logprobs` must be a positive value or -1."),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": -1}, "top_logprobs",
         "when using `top_logprobs`, `logprobs` must be set to true."),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logprobs": -1}, "logprobs",
         "Requested sample logprobs of 49152, which is greater than max allowed: 20"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logprobs": -3}, "logprobs",
         "`logprobs` must be a positive value or -1."),
        ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"a": 1, "5": 2, "\u00b2": 1}},
         "logit_bias", "logit_bias contains key(s) that cannot be converted to integer "
                       "token IDs: ['a', '\u00b2']")]
    for path, body, param, words in cases:
        error = assert_error(post(server, path, body), 400, param)
        assert words in error["message"], (body, error)
    top = post(server, "/v1/chat/completions", {**chat_lp, "top_logprobs": 20})
    assert len(top.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20


def test_invocations_serve_chat_and_completions_as_vllm_does(server, client):
    """SageMaker's route: a chat body answers as /v1/chat/completions, a
    prompt as /v1/completions, anything else is a 400 naming both; /ping
    is /health, open without the key."""
    chat_body = {"messages": CHAT, "max_tokens": 8, "temperature": 0}
    direct = post(server, "/v1/chat/completions", chat_body).json()
    routed = post(server, "/invocations", chat_body).json()
    assert routed["object"] == "chat.completion"
    assert routed["choices"][0]["message"] == direct["choices"][0]["message"]
    text = post(server, "/invocations", {"prompt": "Paris is", "max_tokens": 4,
                                         "temperature": 0}).json()
    assert text["object"] == "text_completion" and text["choices"][0]["text"]
    error = assert_error(post(server, "/invocations", {"hello": 1}), 400)
    assert "Expected one of: ['ChatCompletionRequest', 'CompletionRequest']" in error["message"]
    assert post(server, "/invocations", chat_body, headers={}).status_code == 401
    assert requests.get(server.url + "/ping", timeout=30).json() == {"status": "ok"}


def test_load_counts_the_requests_in_flight(server):
    """--enable-server-load-tracking: /load counts a stream while it runs,
    and forgets it once its client leaves (chapter 09 runs without the
    flag: always 0)."""
    tracking = "--enable-server-load-tracking" in server.process.args
    wait_for(lambda: requests.get(server.url + "/load").json() == {"server_load": 0},
             "the earlier tests' requests done (a client reads its answer before the "
             "server's count drops)")
    with post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4000,
                                              "ignore_eos": True, "stream": True},
              stream=True) as answer:  # long: still streaming when /load is read
        lines = answer.iter_lines()  # held: a dropped generator closes the connection
        next(line for line in lines if line)
        load = requests.get(server.url + "/load", timeout=30).json()["server_load"]
        assert load == (1 if tracking else 0)
    wait_for(lambda: requests.get(server.url + "/load").json()["server_load"] == 0,
             "the stream its client left no longer counted")


def test_tokenizer_info_and_token_strs_for_chat(server, embedded):
    info = requests.get(server.url + "/tokenizer_info", headers=AUTH, timeout=30)
    if "--enable-tokenizer-info-endpoint" not in server.process.args:
        assert info.status_code == 404  # off by default, as in vLLM
    else:
        assert info.json()["tokenizer_class"] == type(embedded.tokenizer).__name__
        assert "<|im_start|>" in info.json()["chat_template"]
        assert not {"vocab_file", "merges_file"} & set(info.json())
    tokens = post(server, "/tokenize", {"messages": CHAT, "return_token_strs": True}).json()
    assert len(tokens["token_strs"]) == tokens["count"] and tokens["token_strs"][0] == "<|im_start|>"


def test_errors_vllms_tests_read_are_worded_as_vllm(server):
    """Out-of-vocabulary prompt ids, an empty prompt, a seed beyond 64 bits:
    vLLM's words (its own tests read them), the field named."""
    cases = [({"prompt": [1, 2, 1000000]}, "prompt", "Token id 1000000 is out of vocabulary"),
             ({"prompt": ""}, "prompt",
              "Either prompt or prompt_embeds must be provided and non-empty."),
             ({"prompt": "Hi", "seed": 2 ** 63}, "seed",
              "Input should be less than or equal to 9223372036854775807")]
    for extra, param, words in cases:
        error = assert_error(post(server, "/v1/completions", {"max_tokens": 2, **extra}),
                             400, param)
        assert words in error["message"], (extra, error)


def test_chat_template_extras_continue_echo_and_custom_roles(server, embedded):
    """vLLM's chat extras: `continue_final_message` leaves the assistant's
    last message open and the model goes on from it (HF's greedy tokens
    after the same prompt ids), `echo` puts that message first in the
    answer, streamed or not; `add_generation_prompt: false` and a custom
    role reach the template as given; both flags on is vLLM's 400."""
    messages = [{"role": "user", "content": "Name the capital of France."},
                {"role": "assistant", "content": "The capital of France is"}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "echo": True,
            "add_generation_prompt": False, "continue_final_message": True,
            "return_token_ids": True}
    answer = post(server, "/v1/chat/completions", body).json()
    prompt = embedded.tokenizer.apply_chat_template(
        messages, tokenize=False, continue_final_message=True)
    prompt_ids = embedded.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert answer["prompt_token_ids"] == prompt_ids
    generated = answer["choices"][0]["token_ids"]
    assert generated == hf_greedy(embedded.model, prompt_ids, 6)[:len(generated)]
    content = answer["choices"][0]["message"]["content"]
    assert content.startswith("The capital of France is") and len(content) > 24
    streamed = data_events(post(server, "/v1/chat/completions", {**body, "stream": True}))
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in streamed
                   if e["choices"])
    assert text == content
    error = assert_error(post(server, "/v1/chat/completions", {
        "messages": messages, "continue_final_message": True}), 400, "continue_final_message")
    assert "Cannot set both `continue_final_message` and `add_generation_prompt`" in \
        error["message"]
    custom = [{"role": "narrator", "content": "Once upon a time"}]
    tokens = post(server, "/tokenize", {"messages": custom,
                                        "add_generation_prompt": False}).json()["tokens"]
    expected = embedded.tokenizer.apply_chat_template(custom, tokenize=False)
    assert tokens == embedded.tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert post(server, "/v1/chat/completions", {"messages": custom, "max_tokens": 2}
                ).status_code == 200


def test_prompt_logprobs_as_vllm_sends_them(server, client, embedded):
    """vLLM's `prompt_logprobs`: per prompt token {token id: {logprob, rank,
    decoded_token}}, the token itself first, the first position null; HF's
    numbers (float32); in chat at the top level, also asked by `echo`;
    refused in a stream, below -1, and beyond 20 in vLLM's words."""
    prompt = "Paris is the capital of France"
    ids = embedded.tokenizer(prompt)["input_ids"]
    answer = client.completions.create(model="course-model", prompt=prompt, max_tokens=2,
                                       temperature=0, extra_body={"prompt_logprobs": 2})
    logprobs = answer.choices[0].prompt_logprobs  # the SDK keeps vLLM's extra field
    with torch.no_grad():
        hf = torch.log_softmax(embedded.model(torch.tensor([ids])).logits[0].float(), -1)
    assert logprobs[0] is None and len(logprobs) == len(ids)
    for p, position in enumerate(logprobs[1:]):
        token = str(ids[p + 1])
        assert list(position)[0] == token and 2 <= len(position) <= 3
        assert position[token]["logprob"] == pytest.approx(float(hf[p, ids[p + 1]]), abs=1e-3)
        assert position[token]["decoded_token"] == embedded.tokenizer.decode([ids[p + 1]])
        assert sorted(e["rank"] for e in position.values())[:2] == [1, 2]
    plain = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None  # null unless asked, as vLLM
    chat = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        "max_tokens": 2, "echo": True, "add_generation_prompt": False,
        "continue_final_message": True}).json()
    assert chat["prompt_logprobs"][0] is None  # echo asks for them (top_logprobs of them: 0)
    assert all(len(position) == 1 for position in chat["prompt_logprobs"][1:])
    for body, words in [({"stream": True, "prompt_logprobs": 1}, "are not available when "
                                                                 "`stream=True`"),
                        ({"prompt_logprobs": -2}, "must be a positive value or -1"),
                        ({"prompt_logprobs": -1}, "Requested prompt logprobs of 49152, which "
                                                  "is greater than max allowed: 20")]:
        error = assert_error(post(server, "/v1/completions", {"prompt": prompt, **body}), 400,
                             "prompt_logprobs")
        assert words in error["message"]


def data_events(answer: requests.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in answer.text.splitlines()
            if line.startswith("data: {")]


@pytest.mark.parametrize("path, base", [
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/completions", {"prompt": "Once upon a time"})])
def test_continuous_usage_stats_puts_each_choices_usage_in_every_chunk(server, path, base):
    """vLLM's `stream_options.continuous_usage_stats`: with `include_usage`,
    every chunk carries its choice's usage so far; the last, choice-less
    chunk the request's. Without `include_usage` it adds nothing (vLLM's rule)."""
    body = {**base, "max_tokens": 5, "n": 2, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    events = data_events(post(server, path, body))
    *per_choice, last = events
    prompt_tokens = last["usage"]["prompt_tokens"]  # counted once, whatever n
    seen = {0: [], 1: []}
    for event in per_choice:
        usage = event["usage"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
        seen[event["choices"][0]["index"]].append(usage["completion_tokens"])
    for counts in seen.values():
        assert counts == sorted(counts) and counts[-1] == 5  # grows to the choice's 5
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    plain = data_events(post(server, path, {**body, "stream_options": {
        "continuous_usage_stats": True}}))
    assert all(event.get("usage") is None for event in plain)


def test_hostile_input_is_a_400_naming_the_param_on_a_kept_connection(server):
    assert_rejected_on_one_connection(server.url, headers=AUTH)
    completions = [
        ({"prompt": "a\ud800b"}, "prompt", None),
        ({"prompt": ["fine", "\udc00"]}, "prompt.1", None),
        ({"prompt": [1, 2, 1000000]}, "prompt", None),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", None),
        ({"prompt": "x", "echo": True}, "echo", None),
        ({"prompt": "x", "suffix": "the end"}, "suffix", None),
        ({"prompt": "x", "best_of": 3}, "best_of", None),
        ({"prompt": "x", "max_tokens": "4"}, "max_tokens", None),
        ({"prompt": "hello " * 9000}, "prompt", "context_length_exceeded"),
    ]
    assert_rejected_on_one_connection(server.url, completions, "/v1/completions", AUTH)


def test_a_bad_request_amid_concurrent_good_ones_hurts_none(server):
    texts = bad_amid_good(server.url, AUTH)
    assert len(set(texts)) == 1 and "Paris" in texts[0]


def test_logit_bias_is_applied(client, embedded):
    plain = chat(client, max_tokens=12).choices[0].message.content
    assert "Paris" in plain
    paris = embedded.tokenizer(" Paris", add_special_tokens=False)["input_ids"]
    biased = chat(client, max_tokens=12, logit_bias={str(paris[0]): -100})
    assert "Paris" not in biased.choices[0].message.content


def test_api_key_guards_every_route_but_the_public_ones(server):
    """Default-deny: every route of the app needs the key (401 without it),
    but those vLLM leaves open; `Bearer` in any case, as RFC 7235 says."""
    for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})]:
        assert_error(post(server, path, body, headers={}), 401)
        assert post(server, path, body).status_code == 200
    assert_error(post(server, "/detokenize", {"tokens": [1000000]}), 400, "tokens")
    from common.entrypoints.middleware import PUBLIC_PATHS
    routes = requests.get(server.url + "/openapi.json", timeout=30).json()["paths"]
    for path, methods in routes.items():
        method = "get" if "get" in methods else "post"
        anonymous = requests.request(method, server.url + path, timeout=60)
        if path in PUBLIC_PATHS:
            assert anonymous.status_code == 200, path
        else:
            assert_error(anonymous, 401)
    assert "/stats" in routes and "/health" in PUBLIC_PATHS
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert requests.get(server.url + "/stats", timeout=30,
                            headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    assert_error(requests.get(server.url + "/stats", headers={"Authorization": KEY}), 401)


def test_unknown_model_404_and_api_key_401(server, client):
    assert_error(post(server, "/v1/chat/completions", {"model": "gpt-4o", "messages": CHAT}),
                 404, "model")
    with pytest.raises(openai.NotFoundError):
        chat(client, model="gpt-4o")
    assert_error(post(server, "/v1/chat/completions", {"messages": CHAT}, headers={}), 401)
    assert_error(post(server, "/v1/models", {}, headers={"Authorization": "Bearer no"}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai_client(server.url, api_key="wrong").models.list()
    assert requests.get(server.url + "/health").status_code == 200  # not under /v1


def test_junk_body_of_2_mb_gets_413_and_the_server_stays_healthy(server, client):
    junk = b"x" * (2 * 1024 * 1024)
    assert_error(post(server, "/v1/chat/completions", junk), 413)
    assert_error(post(server, "/v1/completions", junk, headers={**AUTH, "content-length": ""}),
                 413)
    assert requests.get(server.url + "/health").status_code == 200
    assert chat(client, max_tokens=4).choices[0].message.content


# ------------------------------------------------------------- concurrency
def test_24_concurrent_mixed_requests(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                                    _strict_response_validation=True)

        async def one(i: int):
            kw = dict(model="course-model", messages=PROMPTS[i % 3], max_tokens=8,
                      temperature=0)
            if i % 2:
                chunks = [c async for c in await client.chat.completions.create(
                    stream=True, **kw)]
                return chunks[0].id, "".join(c.choices[0].delta.content or ""
                                             for c in chunks if c.choices)
            answer = await client.chat.completions.create(**kw)
            return answer.id, answer.choices[0].message.content

        return await asyncio.gather(*[one(i) for i in range(24)])

    results = asyncio.run(run())
    assert len({request_id for request_id, _ in results}) == 24
    for i, (_, text) in enumerate(results):
        assert text and text == results[i % 6][1]  # same prompt: same greedy text


def metric(server, name: str) -> float:
    for line in requests.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_closed_streams_are_aborted_and_free_their_blocks(server):
    def open_and_close():
        response = post(server, "/v1/chat/completions", {
            "messages": CHAT, "max_tokens": 4000, "ignore_eos": True, "stream": True},
            stream=True)
        lines = response.iter_lines()
        for _ in range(2):
            next(line for line in lines if line)  # two chunks
        response.close()

    threads = [threading.Thread(target=open_and_close) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_for(lambda: metric(server, "vllm:num_requests_running") == 0
             and metric(server, "vllm:kv_cache_usage_perc") == 0, "the aborts")
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0
    assert requests.get(server.url + "/stats", headers=AUTH).json()["finished"]["abort"] >= 6


# ------------------------------------------------- in-process: fault injection
class LocalServer:
    """The chapter 06 app on a fresh engine over the shared model, served by
    uvicorn in a thread of this process (`make_server`, as `serve` does:
    it shuts down when the engine loop dies)."""

    def __init__(self, loaded=None, max_num_seqs: int = 64, engine=None,
                 timeout_read: float = 30.0, shutdown_timeout: float = 30.0, **app_kw):
        self.engine = engine or AsyncLLM(make_engine(loaded, num_blocks=64,
                                                           max_num_seqs=max_num_seqs))
        self.port = port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = make_server(build_app(self.engine, "local", **app_kw), "127.0.0.1", port,
                                  self.engine if engine is None else None, log_level="warning",
                                  timeout_read=timeout_read, shutdown_timeout=shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def local(embedded):
    server = LocalServer(embedded, max_waiting=2)
    yield server
    server.stop()


def local_chat(server, max_tokens=4, **kw) -> requests.Response:
    return post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": max_tokens,
                                                 "temperature": 0, **kw}, headers={})


def in_threads(n: int, work) -> tuple[list, list[threading.Thread]]:
    """Start `work` n times in threads; returns (results list, threads)."""
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(work())) for _ in range(n)]
    for t in threads:
        t.start()
    return results, threads


def test_queue_full_gets_503_with_retry_after_and_the_queued_requests_finish(embedded):
    local = LocalServer(embedded, max_num_seqs=2, max_waiting=2)
    try:
        with local.engine._lock:  # the engine loop cannot step: requests pile up
            results, threads = in_threads(4, lambda: local_chat(local))
            wait_for(lambda: local.engine.num_waiting() == 2, "2 requests waiting")
            response = local_chat(local)  # 2 running slots, 2 waiting: full
            error = assert_error(response, 503)
            assert "overloaded" in error["message"] and response.headers["retry-after"] == "1"
            # More choices than could ever be admitted: a 400, not "retry later".
            assert_error(local_chat(local, n=5), 400, "n")
        for t in threads:
            t.join()
        assert [r.status_code for r in results] == [200] * 4
    finally:
        local.stop()


def test_a_burst_on_an_idle_server_is_not_refused(local):
    """--max-waiting counts requests that cannot be admitted: 40 arrivals
    with 64 free sequence slots wait for nothing, even before the engine
    loop has taken any of them in."""
    with local.engine._lock:
        results, threads = in_threads(40, lambda: local_chat(local, max_tokens=2))
        wait_for(lambda: local.engine._inbox.qsize() == 40, "40 queued requests")
        assert local.engine.num_waiting() == 0
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 40


def test_internal_error_gives_500_and_the_engine_keeps_serving(local):
    runner = local.engine.engine.worker.model_runner
    original = runner.execute_model

    def broken(batch):
        runner.execute_model = original  # fail once
        raise RuntimeError("simulated kernel failure")

    runner.execute_model = broken
    error = assert_error(local_chat(local), 500)
    assert "simulated kernel failure" in error["message"]
    assert local_chat(local).status_code == 200
    assert local.engine.engine.block_manager.num_free_blocks == 64


def test_an_unexpected_500_keeps_the_keep_alive_connection(local):
    tokenizer = local.engine.tokenizer

    def broken_template(*args, **kw):
        del tokenizer.apply_chat_template  # fail once
        raise RuntimeError("simulated template bug")

    tokenizer.apply_chat_template = broken_template
    port = int(local.url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = json.dumps({"messages": CHAT, "max_tokens": 4, "temperature": 0})
    headers = {"content-type": "application/json"}
    conn.request("POST", "/v1/chat/completions", body, headers)
    first = conn.getresponse()
    error = json.loads(first.read())["error"]
    assert first.status == 500 and "simulated template bug" in error["message"]
    assert error["type"] == "internal_server_error"
    assert not first.will_close and conn.sock is not None
    socket_used = conn.sock
    conn.request("POST", "/v1/chat/completions", body, headers)  # the same connection
    second = conn.getresponse()
    assert second.status == 200 and json.loads(second.read())["choices"]
    assert conn.sock is socket_used
    conn.close()


def test_one_sequence_failing_fails_only_its_own_request(local):
    """A fault while sampling one row (here: the request seeded 666) finishes
    that request with a 500; the requests in the same batches succeed."""
    fail_rows_seeded(local.engine.engine, seed=666)
    with local.engine._lock:  # all of them in the same steps
        good, threads = in_threads(6, lambda: local_chat(local, max_tokens=8, temperature=0.7,
                                                         seed=1))
        bad, bad_threads = in_threads(1, lambda: local_chat(local, max_tokens=8,
                                                            temperature=0.7, seed=666))
        wait_for(lambda: local.engine._inbox.qsize() == 7, "7 queued requests")
    for t in threads + bad_threads:
        t.join()
    assert [r.status_code for r in good] == [200] * 6
    assert len({r.json()["choices"][0]["message"]["content"] for r in good}) == 1
    error = assert_error(bad[0], 500)
    assert "simulated fault in one row" in error["message"]
    assert local.engine.engine.block_manager.num_free_blocks == 64
    assert local.engine.snapshot()["finished"]["error"] == 1


def test_error_after_the_stream_started_is_an_sse_error_event(local):
    runner = local.engine.engine.worker.model_runner
    original, calls = runner.execute_model, []

    def fails_on_third_step(batch):
        calls.append(1)
        if len(calls) == 3:
            runner.execute_model = original
            raise RuntimeError("simulated failure mid-stream")
        return original(batch)

    runner.execute_model = fails_on_third_step
    events = sse_events(local_chat(local, max_tokens=16, stream=True))
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "simulated failure mid-stream" in error["message"]
    assert json.loads(events[1])["choices"][0]["delta"]["content"]  # tokens came first
    assert local_chat(local).status_code == 200


def test_tokenizing_a_prompt_does_not_block_the_event_loop(local):
    """The chat template runs in a worker thread: while one request's
    tokenization is stuck, /health and /v1/models still answer."""
    tokenizer = local.engine.tokenizer
    entered, release = threading.Event(), threading.Event()
    original = tokenizer.apply_chat_template

    def slow_template(*args, **kw):
        entered.set()
        assert release.wait(60)
        return original(*args, **kw)

    tokenizer.apply_chat_template = slow_template
    try:
        results, threads = in_threads(1, lambda: local_chat(local))
        assert entered.wait(60)
        assert requests.get(local.url + "/health", timeout=10).status_code == 200
        assert requests.get(local.url + "/v1/models", timeout=10).status_code == 200
    finally:
        release.set()
        threads[0].join()
        del tokenizer.apply_chat_template  # back to the class's method
    assert results[0].status_code == 200


def test_stats_metrics_and_health_never_wait_for_a_step(local):
    """/stats and /metrics read the figures published after the last step,
    and /health runs on the event loop: while a step holds the engine (here
    for as long as the test likes), 60 clients polling /stats cannot take
    the worker threads that /health or a chat template would need."""
    with local.engine._lock:  # a step that does not end
        def poll() -> int:
            return requests.get(local.url + "/stats", timeout=60).status_code

        results, threads = in_threads(60, poll)
        for t in threads:
            t.join()
        assert results == [200] * 60
        assert requests.get(local.url + "/metrics", timeout=60).status_code == 200
        assert requests.get(local.url + "/health", timeout=60).json() == {"status": "ok"}
        queued, chat_threads = in_threads(1, lambda: local_chat(local))
        wait_for(lambda: local.engine._inbox.qsize() == 1, "the chat templated and queued")
    chat_threads[0].join()
    assert queued[0].status_code == 200


def test_a_stats_flood_is_spaced_out_not_served_at_cpu_speed():
    """RateLimit: 10 requests at once get slots 1/20 s apart (a lower bound
    on the time: asyncio.sleep never wakes early), so 60 clients looping on
    /stats cannot take the CPU from the engine."""
    limit = RateLimit(per_second=20)

    async def flood() -> list[float]:
        start = time.monotonic()

        async def one() -> float:
            await limit.wait()
            return time.monotonic() - start

        return sorted(await asyncio.gather(*(one() for _ in range(10))))

    waited = asyncio.run(flood())
    assert all(seconds >= k / 20 for k, seconds in enumerate(waited))  # slot k: k/20 s on


# ------------------------------------------------- slow and half-open clients
def raw_connection(server, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(data)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection. A server
    that closes with bytes of ours still unread (a byte sent while it hung
    up) resets the connection after its answer: the answer is kept."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    sock.close()
    return received


def assert_408(answer: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert json.loads(body)["error"]["code"] == "request_timeout"


HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: 200\r\n")


def test_half_sent_requests_get_408_and_lose_their_socket_while_others_are_served(embedded):
    """--timeout-read (1 s here): nothing sent, half a head, a whole head but
    half a body, a second request half sent on a kept-alive connection, and
    one byte every 0.2 s (each byte does not restart the clock): each gets a
    408 in OpenAI's envelope and its connection is closed, while 40 more
    half-open sockets leave a good request answered."""
    local = LocalServer(embedded, timeout_read=1.0)
    try:
        hoarded = [raw_connection(local, HEAD) for _ in range(40)]
        assert local_chat(local).status_code == 200
        for data in (b"", HEAD, HEAD + b"\r\n" + b'{"messages": ['):
            assert_408(read_until_closed(raw_connection(local, data)))
        kept = raw_connection(local, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while not answer.endswith(b'{"status":"ok"}'):  # the whole first response
            answer += kept.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 ")
        kept.sendall(HEAD)
        assert_408(read_until_closed(kept))
        drip = raw_connection(local)
        answer = b""
        for byte in HEAD:  # 1 byte / 0.2 s: the server hangs up long before the end
            try:
                drip.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.2)
            if select.select([drip], [], [], 0)[0]:
                answer = read_until_closed(drip)
                break
        assert_408(answer)
        for sock in hoarded:
            assert_408(read_until_closed(sock))
    finally:
        local.stop()


def test_both_content_length_and_transfer_encoding_is_a_400_at_once(embedded):
    """Issue 49: a body with both framings (Transfer-Encoding: chunked, the
    body not chunked) waited out the read deadline for a 408. RFC 9112
    treats that message as an error: a 400 in the envelope, at once (the
    read deadline here is 600 s), and the connection closed."""
    local = LocalServer(embedded, timeout_read=600.0)
    try:
        body = json.dumps({"messages": CHAT, "max_tokens": 2}).encode()
        answer = read_until_closed(raw_connection(local, (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(body)) + body))
        head, _, error = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 "), answer[:200]
        assert "Transfer-Encoding" in json.loads(error)["error"]["message"]
        assert local_chat(local).status_code == 200  # and the server goes on
    finally:
        local.stop()


def test_a_stream_left_at_the_shutdown_timeout_ends_with_an_error_event(embedded):
    """Issue 49: the streams still running when --shutdown-timeout ran out
    were cut with neither an error event nor `[DONE]`, as if the
    connection had dropped. Now each ends with a 503 `server_shutdown`
    event, then `[DONE]`, and its request is aborted."""
    local = LocalServer(embedded, shutdown_timeout=0.5)
    results, threads = in_threads(1, lambda: local_chat(local, max_tokens=900,
                                                        ignore_eos=True, stream=True))
    wait_for(lambda: local.engine.snapshot()["running"] == 1, "a running stream")
    local.stop()
    threads[0].join(60)
    events = sse_events(results[0])
    assert json.loads(events[-2])["error"]["code"] == "server_shutdown", events[-3:]
    assert events[-1] == "[DONE]"
    assert len(events) < 900  # cut, not finished
    wait_for(lambda: local.engine.snapshot()["running"] == 0, "the stream's request aborted")


def test_sigterm_is_bounded_by_shutdown_timeout_and_exits_0(start_server, tmp_path):
    """SIGTERM with a request in flight and 20 half-open connections (whose
    read deadline is far away): these get a 408 at once, the request in
    flight has --shutdown-timeout to finish, then the server closes the
    engine and exits 0 (uvicorn alone re-raised the signal: 143, and
    nothing after `run()` executed)."""
    server = start_server("06", "--timeout-read", "600", "--shutdown-timeout", "2")
    hoarded = [socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
               for _ in range(20)]
    for sock in hoarded:
        sock.sendall(HEAD + b"\r\n{")
    def long_request():
        try:
            return requests.post(server.url + "/v1/chat/completions", timeout=300,
                                 json={"messages": CHAT, "max_tokens": 4000, "ignore_eos": True})
        except requests.ConnectionError as exc:  # cancelled after --shutdown-timeout
            return exc

    in_flight, threads = in_threads(1, long_request)
    wait_for(lambda: requests.get(server.url + "/stats").json()["running"] == 1, "a request")
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=120) == 0
    threads[0].join()
    assert "server stopped" in server.log_tail(40)
    for sock in hoarded:  # still arriving at the shutdown: a 408 at once, not a wait
        assert_408(read_until_closed(sock))


def test_engine_death_503_for_everyone_then_the_server_exits_with_1(embedded):
    local = LocalServer(embedded)
    try:
        results, threads = in_threads(1, lambda: local_chat(local, max_tokens=900,
                                                            ignore_eos=True))
        wait_for(lambda: local.engine.snapshot()["running"] == 1, "a running request")
        stats_before = requests.get(local.url + "/stats").json()
        assert stats_before["engine_alive"] is True

        def dies(*_):
            raise SystemExit("simulated loop death")  # not an Exception: the loop ends

        # No lock: the loop takes it again at once after each step, and a
        # waiter could get it only once the 900 tokens were done. Setting the
        # attribute is atomic; the step under way ends, the next one dies.
        local.engine.engine.step = dies
        threads[0].join()
        error = assert_error(results[0], 503)  # the request in flight
        assert error["code"] == "engine_dead"
        local.thread.join(timeout=60)  # the server shuts itself down
        assert not local.thread.is_alive()
        assert exit_code(local.engine) == 1
        assert local.engine.snapshot()["engine_alive"] is False
        metrics = Metrics(local.engine.snapshot, "local", lambda: local.engine.alive)
        assert b'llm_course:engine_alive{model_name="local"} 0.0' in metrics.render()[0]
    finally:
        local.stop()


def test_dead_engine_answers_503_on_health_chat_and_says_so_in_stats(embedded):
    """Until the server has shut down, every request gets the 503 (here the
    server is not told to exit, so we can look)."""
    engine = AsyncLLM(make_engine(embedded, num_blocks=64))

    def dies(*_):
        raise SystemExit("simulated loop death")

    engine.engine.step = dies
    engine.abort("nothing")  # wake the loop up
    engine._thread.join(timeout=10)
    local = LocalServer(engine=engine)
    try:
        assert assert_error(requests.get(local.url + "/health"), 503)["code"] == "engine_dead"
        assert assert_error(local_chat(local), 503)["code"] == "engine_dead"
        assert requests.get(local.url + "/stats").json()["engine_alive"] is False
        assert 'llm_course:engine_alive{model_name="local"} 0.0' in requests.get(
            local.url + "/metrics").text
    finally:
        local.stop()


def test_default_max_tokens_fits_a_small_cache(local):
    """64 blocks of 16 = 1024 tokens, less than the model's 8192: the default
    max_tokens is what fits in the cache, not a refusal."""
    answer = post(local, "/v1/chat/completions", {"messages": CHAT, "temperature": 0},
                  headers={})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["finish_reason"] == "stop"


def test_openapi_schema_says_400_and_metrics_are_text(local):
    schema = requests.get(local.url + "/openapi.json").json()
    assert '"422"' not in json.dumps(schema)
    chat_responses = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert chat_responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ErrorResponse")
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert_error(local_chat(local, max_tokens="8"), 400, "max_tokens")  # what it promises


def test_disable_fastapi_docs(embedded):
    local = LocalServer(embedded, disable_docs=True)
    try:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert requests.get(local.url + path).status_code == 404
        assert local_chat(local).status_code == 200
    finally:
        local.stop()


# ------------------------------------------------------------ the metrics
SNAPSHOT = {"running": 3, "waiting": 2, "kv_cache_usage_perc": 25.0, "prompt_tokens": 120,
            "generation_tokens": 64, "num_preemptions": 1, "prefix_cache_queries": 10,
            "prefix_cache_hits": 4, "finished": {"stop": 5, "length": 2},
            "waiting_by_reason": {"capacity": 2, "deferred": 0},
            "prompt_tokens_by_source": {"local_compute": 112, "local_cache_hit": 8,
                                        "external_kv_transfer": 0}}


def scrape(metrics) -> dict[str, float]:
    """The text exposition, as {'name{labels}': value}."""
    text = metrics.render()[0].decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


@pytest.mark.ex06
def test_the_engine_collector_reads_the_snapshot_at_scrape_time(impl):
    """Gauges and counters with vLLM's names, read from the engine's
    snapshot when Prometheus scrapes (KV usage as a fraction, not a %)."""
    snapshot = dict(SNAPSHOT)
    metrics = Metrics(lambda: snapshot, "m", lambda: True, impl.EngineCollector,
                      impl.LatencyStatLogger)
    values = scrape(metrics)
    label = '{model_name="m"}'
    assert values["vllm:num_requests_running" + label] == 3
    assert values["vllm:num_requests_waiting" + label] == 2
    assert values["vllm:kv_cache_usage_perc" + label] == 0.25
    assert values["vllm:prompt_tokens_total" + label] == 120
    assert values["vllm:generation_tokens_total" + label] == 64
    assert values["vllm:num_preemptions_total" + label] == 1
    assert values["vllm:prefix_cache_queries_total" + label] == 10
    assert values["vllm:prefix_cache_hits_total" + label] == 4
    assert values['vllm:request_success_total{finished_reason="stop",model_name="m"}'] == 5
    assert values['vllm:request_success_total{finished_reason="length",model_name="m"}'] == 2
    assert values["llm_course:engine_alive" + label] == 1
    assert values['vllm:num_requests_waiting_by_reason{model_name="m",reason="capacity"}'] == 2
    assert values['vllm:num_requests_waiting_by_reason{model_name="m",reason="deferred"}'] == 0
    source = 'vllm:prompt_tokens_by_source_total{model_name="m",source="%s"}'
    assert values[source % "local_compute"] == 112
    assert values[source % "local_cache_hit"] == 8
    assert values[source % "external_kv_transfer"] == 0
    assert values["vllm:prompt_tokens_cached_total" + label] == 8


@pytest.mark.ex06
def test_request_success_is_one_metric_with_a_sample_per_reason(impl):
    """vllm:request_success is one counter (one # TYPE line, which
    Prometheus requires) with a sample per finish reason the engine
    counted, told apart by the label finished_reason."""
    snapshot = dict(SNAPSHOT, finished={"stop": 5, "length": 2, "abort": 1})
    metrics = Metrics(lambda: snapshot, "m", lambda: True, impl.EngineCollector,
                      impl.LatencyStatLogger)
    text = metrics.render()[0].decode()
    types = [line for line in text.splitlines()
             if line.startswith("# TYPE vllm:request_success")]
    assert types == ["# TYPE vllm:request_success_total counter"], (
        f"one counter family for every reason, not one per reason: {types}")
    samples = sorted(line for line in text.splitlines()
                     if line.startswith("vllm:request_success"))
    assert samples == [
        'vllm:request_success_total{finished_reason="abort",model_name="m"} 1.0',
        'vllm:request_success_total{finished_reason="length",model_name="m"} 2.0',
        'vllm:request_success_total{finished_reason="stop",model_name="m"} 5.0'], samples


@pytest.mark.ex06
def test_every_scrape_reads_the_engine_anew(impl):
    """The collector keeps the functions it is given and calls them at
    every scrape: the same snapshot scraped twice gives the same figures
    (a counter is the engine's total, not what changed since the last
    scrape); a changed snapshot shows at the next scrape; a dead engine
    says 0 at once."""
    snapshot = dict(SNAPSHOT)
    alive = [True]
    metrics = Metrics(lambda: dict(snapshot), "m", lambda: alive[0],  # a new dict each time,
                      impl.EngineCollector, impl.LatencyStatLogger)  # as engine.snapshot()
    label = '{model_name="m"}'
    first = scrape(metrics)
    again = scrape(metrics)
    changed = sorted(name for name in first if again.get(name) != first[name])
    assert not changed, f"scraped twice, the same snapshot gave other figures: {changed}"
    snapshot.update(running=7, kv_cache_usage_perc=50.0, generation_tokens=80,
                    finished={"stop": 6, "length": 2})
    alive[0] = False
    values = scrape(metrics)
    assert values["vllm:num_requests_running" + label] == 7, "read snapshot() at each scrape"
    assert values["vllm:kv_cache_usage_perc" + label] == 0.5
    assert values["vllm:generation_tokens_total" + label] == 80
    assert values['vllm:request_success_total{finished_reason="stop",model_name="m"}'] == 6
    assert values["llm_course:engine_alive" + label] == 0, "read alive() at each scrape"


def test_every_help_line_reads_as_a_sentence():
    """`curl /metrics` and Prometheus' metadata show each metric's # HELP:
    a sentence, from a capital (or a figure) to a full stop, in lower case
    but for acronyms (no word of three capitals or more)."""
    import re
    snapshot = dict(SNAPSHOT, iteration_tokens={"bounds": [1, 2], "counts": [1, 0, 0],
                                                "sum": 1.0})
    text = Metrics(lambda: snapshot, "m", cache_config={"block_size": 16}).render()[0].decode()
    helps = [line.split(" ", 3)[3] for line in text.splitlines() if line.startswith("# HELP ")]
    assert len(helps) > 30
    for doc in helps:
        assert re.fullmatch(r"[A-Z0-9].*\.", doc), f"# HELP {doc!r}: a sentence, capital to stop"
        shouting = re.findall(r"\b[A-Z]{3,}\b", doc)
        assert not shouting and "XX" not in doc, f"# HELP {doc!r}: {shouting}"


def finished_request(request_id: str, e2e: float, queued: float,
                     tokens: int) -> FinishedRequestStats:
    """A finished request's figures, as the engine fills them."""
    decode = e2e - queued - 0.25  # after a prefill of 0.25 s
    return FinishedRequestStats(
        request_id=request_id, finish_reason="length", e2e_latency=e2e, num_prompt_tokens=5,
        num_generation_tokens=tokens, max_tokens_param=tokens, queued_time=queued,
        prefill_time=0.25, inference_time=e2e - queued, decode_time=decode,
        mean_time_per_output_token=decode / (tokens - 1))


def three_steps() -> list[IterationStats]:
    """Three engine steps of two requests, a and b (both admitted at step 1)."""
    first, second, third = IterationStats(10.0), IterationStats(10.25), IterationStats(10.5)
    first.time_to_first_tokens_iter = [0.5, 0.75]  # a's and b's first tokens
    second.inter_token_latencies_iter = [0.125, 0.25]  # a's and b's second tokens
    third.inter_token_latencies_iter = [0.25]  # a's third; b finished at step 2
    second.finished_requests = [finished_request("b", 1.5, 0.5, tokens=2)]
    third.finished_requests = [finished_request("a", 2.0, 0.25, tokens=3)]
    return [first, second, third]


@pytest.mark.ex06
def test_the_latency_stat_logger_observes_ttft_itl_e2e_and_queue_time(impl):
    """Three engine steps' IterationStats: 2 TTFTs, 3 inter-token gaps, and
    for the 2 finished requests their e2e latency and queue time, in
    seconds, each observed at the step that measured it (the TTFTs after
    the first step); a step where nothing happened observes nothing."""
    metrics = Metrics(lambda: SNAPSHOT, "m", lambda: True, impl.EngineCollector,
                      impl.LatencyStatLogger)
    steps = [*three_steps(), IterationStats(10.75)]
    label = '{model_name="m"}'
    metrics.record(steps[0])  # as the engine calls it after each step
    values = scrape(metrics)  # the first tokens are observed at the step that made them
    assert values[f"vllm:time_to_first_token_seconds_count{label}"] == 2
    assert values[f"vllm:e2e_request_latency_seconds_count{label}"] == 0
    for step in steps[1:]:
        metrics.record(step)
    values = scrape(metrics)

    def histogram(name: str) -> tuple[float, float]:
        return values[f"vllm:{name}_count{label}"], values[f"vllm:{name}_sum{label}"]

    assert histogram("time_to_first_token_seconds") == (2, 1.25)
    assert histogram("inter_token_latency_seconds") == (3, 0.625)
    assert histogram("e2e_request_latency_seconds") == (2, 3.5)
    assert histogram("request_queue_time_seconds") == (2, 0.75)
    assert values['vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="m"}'] == 1
    assert values['vllm:inter_token_latency_seconds_bucket{le="0.15",model_name="m"}'] == 1


@pytest.mark.ex06
def test_metrics_endpoint_of_a_served_engine(embedded, impl):
    """The app serves the metrics it is given, and the engine times every
    token: after a chat (one output) and a stream (four), /metrics counts
    them with vLLM's names, 3 inter-token gaps each."""
    engine = AsyncLLM(make_engine(embedded, num_blocks=64))
    metrics = Metrics(engine.snapshot, "local", lambda: engine.alive, impl.EngineCollector,
                      impl.LatencyStatLogger)
    local = LocalServer(engine=engine, metrics=metrics)
    try:
        answer = local_chat(local, max_tokens=4)
        assert answer.status_code == 200, answer.text  # a 500's body names the error
        events = sse_events(local_chat(local, max_tokens=4, stream=True))
        assert events[-1] == "[DONE]" and '"error"' not in events[-2], events[-2]
        text = requests.get(local.url + "/metrics").text
        assert 'vllm:request_success_total{finished_reason="length",model_name="local"} 2.0' \
            in text
        assert 'vllm:generation_tokens_total{model_name="local"} 8.0' in text
        assert 'vllm:time_to_first_token_seconds_count{model_name="local"} 2.0' in text
        assert 'vllm:inter_token_latency_seconds_count{model_name="local"} 6.0' in text
    finally:
        local.stop()


def test_the_wire_items_vllm_has_as_flags_and_words(embedded):
    """Issue 49, the wire as vLLM's own tests read it:
    --enable-prompt-tokens-details puts the prefix cache's tokens in the
    usage (whole and streamed); --max-logprobs moves the cap of 20;
    out-of-vocabulary ids in logit_bias and stop_token_ids are named with
    the vocabulary's size in vLLM's words; a whole answer carries
    `prompt_logprobs: null`; a chat stream's finish reason rides on its last
    delta and its chunks carry `usage` only when they have one; the cache's
    info metric says its size in tokens."""
    engine = AsyncLLM(make_engine(embedded, num_blocks=64, enable_prefix_caching=True))
    local = LocalServer(engine=engine, prompt_tokens_details=True, max_logprobs=30)
    try:
        system = {"role": "system", "content": "You answer questions. " * 12}
        body = {"messages": [system, *CHAT], "max_tokens": 4, "temperature": 0}
        first = post(local, "/v1/chat/completions", body, headers={}).json()
        again = post(local, "/v1/chat/completions", body, headers={}).json()
        assert first["prompt_logprobs"] is None
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 16 and cached % 16 == 0  # whole blocks of the shared prompt
        streamed = sse_events(post(local, "/v1/chat/completions", {
            **body, "stream": True, "stream_options": {"include_usage": True}}, headers={}))
        chunks = [json.loads(e) for e in streamed[:-1]]
        assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        assert all("usage" not in c for c in chunks[:-1])
        finish = chunks[-2]["choices"][0]
        assert finish["finish_reason"] == "length" and finish["delta"]["content"]
        assert post(local, "/v1/completions", {"prompt": "Hi", "max_tokens": 1,
                                                "prompt_logprobs": 25}, headers={}).ok
        for param in ("logit_bias", "stop_token_ids"):
            value = {"60000": 1, "5": 1} if param == "logit_bias" else [60000, 5]
            error = post(local, "/v1/chat/completions", {**body, param: value},
                         headers={}).json()["error"]
            assert error["message"] == (f"token_id(s) [60000] in {param} contain out-of-vocab "
                                        "token ids. Vocabulary size: 49152")
            assert error["param"] == param
        info = next(line for line in requests.get(local.url + "/metrics").text.splitlines()
                    if line.startswith("vllm:cache_config_info{"))
        assert 'kv_cache_size_tokens="1024"' in info  # 64 blocks of 16
    finally:
        local.stop()
        engine.close()
    plain = LocalServer(embedded)
    try:
        answer = post(plain, "/v1/completions", {"prompt": "Hi", "max_tokens": 1,
                                                  "prompt_logprobs": 25}, headers={})
        assert answer.status_code == 400 and "max allowed: 20" in answer.json()["error"]["message"]
        usage = post(plain, "/v1/completions", {"prompt": "Hi", "max_tokens": 1},
                     headers={}).json()["usage"]
        assert "prompt_tokens_details" not in usage
    finally:
        plain.stop()
