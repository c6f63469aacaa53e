"""Beam search at the front (common/entrypoints/beam_search.py, ch06), vLLM v1's way.

The step and the end on hand-made logprobs; one beam equals greedy
decoding (HF's `model.generate`); the offline `LLM.beam_search` and the
server's `use_beam_search` give the same beams; each step finds the
beams' shared history in the prefix cache (the live view's frames say
so). The real vLLM's answer to the same request: tests/test_vllm.py.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import requests

from common.entrypoints.beam_search import (
    BeamSearchParams,
    BeamSearchSequence,
    best_beams,
    next_beams,
    score,
)
from common.entrypoints.llm import LLM
from common.layers.sampler import SampledToken
from tests.conftest import hf_greedy

EOS = 2


def one_token(top: dict[int, float]) -> SimpleNamespace:
    """A beam's one-token output: the sampled token (the likeliest) and its top ones."""
    best = max(top, key=top.get)
    sampled = SampledToken(best, top[best], sorted(top.items(), key=lambda kv: -kv[1]))
    return SimpleNamespace(outputs=[SimpleNamespace(logprobs=[sampled])])


def test_a_step_keeps_the_best_beams_and_sets_eos_aside():
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    beams = [BeamSearchSequence([7, 8], -1.0), BeamSearchSequence([7, 9], -1.5)]
    done: list[BeamSearchSequence] = []
    kept = next_beams(beams, [one_token({10: -0.1, EOS: -0.2, 11: -3.0}),
                              one_token({12: -0.3, 13: -0.4})], params, EOS, done)
    assert [(b.tokens, round(b.cum_logprob, 2)) for b in kept] == [([7, 8, 10], -1.1),
                                                                   ([7, 9, 12], -1.8)]
    assert [(b.tokens, b.finish_reason, round(b.cum_logprob, 2)) for b in done] == [
        ([7, 8], "stop", -1.2)]  # EOS ends the beam; its token is not kept
    assert next_beams(beams[:1], [one_token({EOS: -0.1, 10: -0.2})],
                      BeamSearchParams(2, 4, ignore_eos=True), EOS, done)[0].tokens == [7, 8, 2]


def test_the_end_ranks_by_length_penalized_score():
    """vLLM's score: the summed logprob over the whole length ** penalty."""
    short = BeamSearchSequence([1, 2, 3], -3.0, "stop")  # -1.0 a token
    long = BeamSearchSequence([1, 2, 3, 4, 5, 6], -4.2)  # -0.7 a token
    assert score(short, 1.0) == -1.0 and score(long, 0.0) == -4.2
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: " ".join(map(str, ids)))
    ranked = best_beams([short], [long], BeamSearchParams(2, 3), 2, tokenizer)
    assert ranked == [long, short] and long.text == "3 4 5 6" and short.text == "3"
    unpenalized = best_beams([short], [long], BeamSearchParams(1, 3, length_penalty=0.0),
                             2, tokenizer)
    assert unpenalized == [short]  # summed logprobs alone favour the short one


@pytest.fixture(scope="module")
def llm(embedded):
    return LLM(loaded=embedded, chapter="06", dtype="float32", device_memory_gb=2.0,
               enable_prefix_caching=True)


def test_one_beam_is_greedy_decoding(llm, embedded):
    """Width 1: each step keeps the likeliest token, as HF's greedy does."""
    prompt = embedded.tokenizer("The capital of France is")["input_ids"]
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=12,
                                                     ignore_eos=True))
    beam = out[0].sequences[0]
    assert beam.tokens[len(prompt):] == hf_greedy(embedded.model, prompt, 12)


def test_beams_share_their_history_in_the_prefix_cache(llm, embedded):
    """Every step sends each beam's whole token list; its history's full
    blocks come from the cache. The live view's frames show it: after the
    first step, each beam's prefill computes only what the cache lacks."""
    frames = []
    llm.engine.enable_step_events().subscribe(frames.append)
    prompt = embedded.tokenizer("Once upon a time, " * 12)["input_ids"]  # > 3 blocks
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=4))
    assert len(out[0].sequences) == 3 and len({tuple(b.tokens) for b in out[0].sequences}) == 3
    prefills = [row for frame in frames for row in frame["batch"] if row["kind"] == "prefill"]
    assert len(prefills) == 1 + 3 * 3  # the prompt, then 3 beams in each of 3 steps
    cached_history = len(prompt) // 16 * 16
    assert prefills[0]["num_tokens"] == len(prompt)
    assert all(row["num_tokens"] <= len(prompt) + 4 - cached_history for row in prefills[1:])


def test_the_server_answers_use_beam_search_as_the_offline_llm(start_server, llm):
    server = start_server("06")
    body = {"prompt": "The capital of France is", "max_tokens": 6, "n": 3,
            "use_beam_search": True, "temperature": 0}
    answer = requests.post(server.url + "/v1/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    offline = llm.beam_search(["The capital of France is"],
                              BeamSearchParams(beam_width=3, max_tokens=6))[0].sequences
    assert [c["text"] for c in choices] == [b.text for b in offline]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert answer.json()["usage"]["completion_tokens"] == sum(
        len(b.tokens) - len(llm.tokenizer("The capital of France is")["input_ids"])
        for b in offline)
    streamed = requests.post(server.url + "/v1/completions", json={**body, "stream": True},
                             timeout=60)
    assert streamed.status_code == 400
    assert streamed.json()["error"]["message"] == ("Streaming is not currently supported "
                                                   "with beam search")
    chat = requests.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "use_beam_search": True})
    assert chat.status_code == 400 and "/v1/completions" in json.dumps(chat.json())
