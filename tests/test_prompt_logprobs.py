"""vLLM's prompt_logprobs (ch06): the prompt's own logprobs, from the prefill.

The reference is HF's forward pass over the whole prompt in float32: each
position's log-softmax gives the logprob of the token after it. The engine
must give the same numbers however the prompt is computed: in one step, in
chunks of a small token budget, beside a request that warmed the prefix
cache (the asker reads nothing from it, vLLM's rule), after a preemption
(recomputed, not collected twice). The perplexity they give is HF's.
"""
from __future__ import annotations

import math

import pytest
import torch

from common.sampling_params import RequestOutputKind, SamplingParams
from tests.engine_helpers import greedy, make_engine, run_all

pytestmark = pytest.mark.ch06

TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, "
        "and Rome is the capital of Italy. ") * 3
TOP = 3
ATOL = 1e-4  # nats, float32


@pytest.fixture(scope="module")
def prompt(embedded) -> list[int]:
    return embedded.tokenizer(TEXT)["input_ids"]


@pytest.fixture(scope="module")
def hf_logprobs(embedded, prompt) -> torch.Tensor:
    """(len(prompt) - 1, vocab): row p is the log-softmax predicting prompt[p + 1]."""
    with torch.no_grad():
        logits = embedded.model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def collect(engine, prompts: dict[str, list[int]], params: SamplingParams) -> dict:
    """Step to the end; request id -> (its first output's prompt_logprobs,
    its tokens, its num_cached_tokens)."""
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, params)
    got, tokens = {}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id not in got:
                got[output.request_id] = (output.prompt_logprobs, output.num_cached_tokens)
            tokens.setdefault(output.request_id, []).extend(output.outputs[0].token_ids)
    return {r: (*got[r], tokens[r]) for r in got}


def assert_equals_hf(prompt_logprobs, prompt: list[int], hf: torch.Tensor, top: int) -> None:
    assert prompt_logprobs[0] is None  # nothing predicts the first token
    assert len(prompt_logprobs) == len(prompt)
    for p, entry in enumerate(prompt_logprobs[1:]):
        row, token = hf[p], prompt[p + 1]
        assert entry.token_id == token
        assert abs(entry.logprob - float(row[token])) < ATOL, p
        assert entry.rank == int((row > row[token]).sum()) + 1, p
        values, ids = row.topk(top)
        assert len(entry.top_logprobs) == top
        for (got_id, got_lp), want_id, want_lp in zip(entry.top_logprobs, ids.tolist(),
                                                      values.tolist()):
            assert abs(got_lp - want_lp) < ATOL
            assert got_id == want_id or abs(got_lp - float(row[got_id])) < ATOL  # a tie


@pytest.mark.parametrize("budget", [512, 16], ids=["one-step", "chunks-of-16"])
def test_prompt_logprobs_equal_hf_in_one_step_or_in_chunks(embedded, prompt, hf_logprobs,
                                                           budget):
    engine = make_engine(embedded, max_num_batched_tokens=budget,
                         long_prefill_token_threshold=budget)
    (logprobs, _, tokens), = collect(engine, {"a": prompt},
                                     greedy(8, prompt_logprobs=TOP)).values()
    assert_equals_hf(logprobs, prompt, hf_logprobs, TOP)
    plain = run_all(make_engine(embedded), {"a": prompt}, greedy(8))["a"]
    assert tokens == plain.token_ids  # asking for them changes no token


def test_a_cached_prefix_is_not_read_by_the_asker(embedded, prompt, hf_logprobs):
    engine = make_engine(embedded, enable_prefix_caching=True)
    warm = collect(engine, {"warm": prompt}, greedy(2))["warm"]
    again = collect(engine, {"again": prompt}, greedy(2))["again"]
    asker = collect(engine, {"asker": prompt}, greedy(2, prompt_logprobs=0))["asker"]
    assert warm[1] == 0 and again[1] > 0  # the cache works...
    assert asker[1] == 0  # ...and the asker computes every prompt token
    assert_equals_hf(asker[0], prompt, hf_logprobs, 0)


def test_a_preempted_asker_collects_each_logprob_once(embedded, prompt, hf_logprobs):
    engine = make_engine(embedded, num_blocks=12, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True, prompt_logprobs=1,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    out = collect(engine, {"a": prompt[:60], "b": prompt[:60]}, params)
    assert engine.scheduler.num_preemptions > 0  # a sequence was recomputed
    for logprobs, _, _ in out.values():
        assert_equals_hf(logprobs, prompt[:60], hf_logprobs, 1)


def test_the_perplexity_is_hfs(embedded, prompt):
    """What people measure with vLLM's prompt_logprobs: exp(-mean logprob)."""
    (logprobs, _, _), = collect(make_engine(embedded), {"a": prompt},
                                greedy(1, prompt_logprobs=0)).values()
    ours = math.exp(-sum(e.logprob for e in logprobs[1:]) / (len(prompt) - 1))
    with torch.no_grad():
        ids = torch.tensor([prompt])
        hf = math.exp(float(embedded.model(ids, labels=ids).loss))
    assert ours == pytest.approx(hf, rel=1e-4)


def test_prompt_logprobs_bounds():
    with pytest.raises(ValueError):
        SamplingParams(prompt_logprobs=-2)
    SamplingParams(prompt_logprobs=-1)  # the vocabulary
