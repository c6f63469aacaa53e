"""Chapter 10's server (10-adapters/server.py) as a client sees it: adapters
by name, mixed in one batch, loaded and unloaded while it serves, with
vLLM's routes, errors and metric. One server for the module, two seeded
random peft adapters; the reference is HF `generate` on peft's merged
models, float32 greedy."""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from fastapi.testclient import TestClient

from common.entrypoints.middleware import new_app
from common.entrypoints.serving_models import RUNTIME_UPDATES, OpenAIServingModels
from common.loader import apply_chat_template
from tests.adapters import peft_adapter
from tests.conftest import PROMPTS, ROOT, hf_greedy, openai_client

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(embedded, tmp_path_factory):
    """name -> (folder, merged model): two adapters on every projection
    LoRA touches, and a third, loaded at run time, on q and v only."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {"alpha": (8, 16, 1, None), "beta": (4, 8, 2, None),
             "gamma": (8, 8, 3, ("q_proj", "v_proj"))}
    made = {}
    for name, (rank, alpha, seed, targets) in specs.items():
        kw = {"targets": targets} if targets else {}
        made[name] = (root / name, peft_adapter(embedded.model, root / name, rank, alpha,
                                                seed, **kw))
    return made


@pytest.fixture(scope="module")
def server(start_server, adapters):
    """max-loras 1: a step holds one adapter; requests of the other wait."""
    patch = pytest.MonkeyPatch()
    patch.setenv(RUNTIME_UPDATES, "true")  # read by the server at start
    started = start_server("10", "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8",
                           "--lora-modules", f"alpha={adapters['alpha'][0]}",
                           json.dumps({"name": "beta", "path": str(adapters["beta"][0])}))
    patch.undo()
    return started


@pytest.fixture(scope="module")
def expected(embedded, adapters):
    """(model name, prompt index) -> HF's greedy tokens on the merged model."""
    models = {"base": embedded.model} | {name: merged for name, (_, merged) in adapters.items()}
    out = {}
    for name, model in models.items():
        for i in range(2):
            ids = apply_chat_template(embedded.tokenizer, PROMPTS[i])
            out[name, i] = hf_greedy(model, ids, MAX_TOKENS)
    assert out["alpha", 0] != out["base", 0] and out["beta", 0] != out["base", 0]
    return out


def chat_ids(server, model: str | None, prompt: int) -> tuple[int, dict]:
    body = {"messages": PROMPTS[prompt], "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True} | ({"model": model} if model else {})
    answer = requests.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    return answer.status_code, answer.json()


def test_models_lists_each_adapter_with_its_parent(server, adapters):
    cards = requests.get(server.url + "/v1/models", timeout=10).json()["data"]
    base = cards[0]["id"]
    assert [c["id"] for c in cards] == [base, "alpha", "beta"]
    assert cards[0]["parent"] is None and cards[0]["max_model_len"] > 0
    assert cards[0]["root"] == "smollm2"  # the model it loaded, as vLLM's root says
    assert {c["id"]: (c["parent"], c["root"]) for c in cards[1:]} == {
        "alpha": (base, str(adapters["alpha"][0])), "beta": (base, str(adapters["beta"][0]))}


def test_each_adapter_answers_as_its_merged_model_and_says_its_name(server, expected):
    client = openai_client(server.url)
    for name in ("alpha", "beta"):
        answer = client.chat.completions.create(model=name, messages=PROMPTS[0],
                                                max_tokens=MAX_TOKENS, temperature=0,
                                                extra_body={"return_token_ids": True})
        assert answer.model == name
        assert answer.choices[0].token_ids == expected[name, 0]
    status, base = chat_ids(server, None, 0)
    assert status == 200 and base["choices"][0]["token_ids"] == expected["base", 0]


def test_mixed_traffic_gives_each_request_its_own_tokens(server, expected):
    """Twelve requests at once over the base model and two adapters, with
    one adapter slot: every answer is what its model gives alone."""
    jobs = [(model, i) for model in (None, "alpha", "beta") for i in range(2)] * 2
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: chat_ids(server, *job), jobs))
    for (model, i), (status, body) in zip(jobs, answers):
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == expected[model or "base", i], (model, i)


def test_a_streamed_answer_names_the_adapter(server):
    stream = requests.post(server.url + "/v1/completions", json={
        "model": "beta", "prompt": "Hello", "max_tokens": 3, "stream": True}, stream=True,
        timeout=60)
    chunks = [json.loads(line[6:]) for line in stream.iter_lines(decode_unicode=True)
              if line.startswith("data: {")]
    assert chunks and {chunk["model"] for chunk in chunks} == {"beta"}


def test_an_unknown_model_gets_vllms_404_and_the_server_goes_on(server):
    status, body = chat_ids(server, "nobody", 0)
    assert status == 404
    assert body["error"]["message"].startswith("The model `nobody` does not exist.")
    assert body["error"]["type"] == "NotFoundError" and body["error"]["param"] == "model"
    assert chat_ids(server, "alpha", 1)[0] == 200


def test_adapters_load_and_unload_at_run_time(server, adapters, expected):
    url = server.url
    load = {"lora_name": "gamma", "lora_path": str(adapters["gamma"][0])}
    answer = requests.post(url + "/v1/load_lora_adapter", json=load, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.text == "Success: LoRA adapter 'gamma' added successfully."
    status, body = chat_ids(server, "gamma", 1)
    assert status == 200 and body["choices"][0]["token_ids"] == expected["gamma", 1]
    again = requests.post(url + "/v1/load_lora_adapter", json=load, timeout=60)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    missing = requests.post(url + "/v1/load_lora_adapter", timeout=60, json={
        "lora_name": "delta", "lora_path": str(adapters["gamma"][0].parent / "none")})
    assert missing.status_code == 404
    assert missing.json()["error"]["message"].startswith("Loading lora delta failed: "
                                                         "No adapter found for ")
    gone = requests.post(url + "/v1/unload_lora_adapter", json={"lora_name": "gamma"},
                         timeout=60)
    assert gone.status_code == 200, gone.text
    assert chat_ids(server, "gamma", 1)[0] == 404
    assert requests.post(url + "/v1/unload_lora_adapter", json={"lora_name": "gamma"},
                         timeout=60).status_code == 404
    assert [c["id"] for c in requests.get(url + "/v1/models", timeout=10).json()["data"]][1:] \
        == ["alpha", "beta"]


def test_metrics_tell_the_adapters_in_use_with_vllms_labels(server):
    chat_ids(server, "alpha", 0)
    text = requests.get(server.url + "/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert lines, text[:2000]
    assert all('max_lora="1"' in line and "running_lora_adapters=" in line
               and "waiting_lora_adapters=" in line for line in lines)


def test_load_and_unload_routes_exist_only_behind_vllms_switch(monkeypatch):
    monkeypatch.delenv(RUNTIME_UPDATES, raising=False)
    app = new_app("models", "0")
    OpenAIServingModels("base", 1, 8, []).add_routes(app)
    assert TestClient(app).post("/v1/load_lora_adapter", json={}).status_code == 404
    monkeypatch.setenv(RUNTIME_UPDATES, "1")
    OpenAIServingModels("base", 1, 8, []).add_routes(app)
    answer = TestClient(app).post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == ("Both 'lora_name' and 'lora_path' must be "
                                                 "provided.")


def test_a_bad_lora_module_stops_the_server_at_start(tmp_path):
    """Checked before the model loads: a usage error (exit code 2) naming the folder."""
    result = subprocess.run(
        [sys.executable, "10-adapters/server.py", "--enable-lora", "--lora-modules",
         f"x={tmp_path / 'none'}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "Loading lora x failed: No adapter found for" in result.stderr
