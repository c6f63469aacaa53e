"""Speculative decoding (ch07): n-gram drafts, checked in one pass, lossless.

The grading tests of exercise 07b (`make exercise CH=07b`) are marked ex07b:
the learner's `rejection_sample`, checked statistically (it must keep the
model's distribution) and on the greedy and seeded rules.
"""
from __future__ import annotations

import pytest
import torch

from bench.peers.vllm_checks import PROMPT_SET
from common.config import SpeculativeConfig
from common.core.scheduler import ContinuousScheduler
from common.spec_decode.ngram_proposer import NgramProposer
from common.layers.rejection_sampler import greedy_verify
from common.loader import apply_chat_template
from common.sampling_params import SamplingParams, StructuredOutputsParams
from tests.engine_helpers import greedy, make_engine, run_all

pytestmark = pytest.mark.ch07

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}
REPEAT = ("Repeat this list exactly, twice: apples, pears, plums, cherries, grapes, "
          "lemons, limes, figs, dates, melons.")


# ---------------------------------------------- exercise 07b: the rule itself
def first_token_frequencies(sample, probs: torch.Tensor, drafts: list[int],
                            trials: int) -> torch.Tensor:
    """How often each token comes out first, over `trials` calls of `sample`."""
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(probs.shape[-1])
    for _ in range(trials):
        counts[sample(probs, drafts, gen)[0]] += 1
    return counts / trials


def close_to(freqs: torch.Tensor, p: torch.Tensor, trials: int) -> bool:
    """Every frequency within 5 standard errors of its probability."""
    stderr = torch.sqrt(p * (1 - p) / trials).clamp_min(1e-3)
    return bool(((freqs - p).abs() <= 5 * stderr).all())


def no_residual(probs: torch.Tensor, drafts: list[int], gen) -> list[int]:
    """The rule with its correction removed: on a rejection, sample from p
    itself (the draft not taken out). It over-produces the draft token."""
    for j, draft in enumerate(drafts):
        if torch.rand((), generator=gen) < probs[j][draft]:
            continue
        return [int(torch.multinomial(probs[j], 1, generator=gen))]
    return [int(torch.multinomial(probs[-1], 1, generator=gen))]


TOY = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25]])  # (k + 1, vocab)


@pytest.mark.ex07b
def test_each_draft_is_accepted_with_its_probability(impl):
    """Accept a draft with the probability p(d) the model gives it: one
    uniform draw per draft, accepted when below p(d); not when d is the
    most likely token, not always. Two drafts, 20,000 trials: the first
    is accepted (then at least one more token follows) 4 times in 10."""
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.3, 0.4, 0.2, 0.1], [0.25] * 4])
    gen, trials = torch.Generator().manual_seed(3), 20_000
    accepted = sum(len(impl.rejection_sample(probs, [1, 2], gen)) >= 2 for _ in range(trials))
    p = torch.tensor([0.4])
    assert close_to(torch.tensor([accepted / trials]), p, trials), (
        f"draft 1 (p = 0.4) accepted in {accepted / trials:.3f} of the trials, not 0.4")
    never = torch.tensor([[0.0, 0.5, 0.5], [0.0, 0.5, 0.5]])
    assert all(impl.rejection_sample(never, [0], gen)[0] != 0 for _ in range(200)), (
        "a draft the model gives probability 0 must never be accepted")


@pytest.mark.ex07b
def test_each_draft_is_judged_by_the_row_before_it(impl):
    """Row 0 judges draft 0, row j draft j, the last row is for the bonus.
    Rows of 0s and 1s, so nothing is left to chance: row 0 is sure of
    draft 1, row 1 gives draft 2 probability 0 and 0 is its only other
    token."""
    one_hot = torch.nn.functional.one_hot
    rows = torch.stack([one_hot(torch.tensor(1), 4), one_hot(torch.tensor(0), 4),
                        one_hot(torch.tensor(3), 4)]).float()  # (k + 1, vocab)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        got = impl.rejection_sample(rows, [1, 2], gen)
        assert got == [1, 0], f"{got}: row 0 accepts draft 1, row 1 rejects draft 2 and " \
            "replaces it by 0, then stop"


@pytest.mark.ex07b
def test_every_draw_comes_from_the_generator_and_ids_are_ints(impl):
    """A seeded generator replays: the same seed gives the same tokens on
    a rejection (the replacement too) and on an acceptance (the bonus
    too), and every id is a Python int."""
    noise = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(5)), -1)
    sure = torch.nn.functional.one_hot(torch.tensor([7, 8]), 50).float()
    probs = torch.cat([0.2 * noise[:2] + 0.8 * sure, noise[2:]])  # drafts 7, 8 likely: both
    # accepted about 2 times in 3, then a bonus from a spread-out last row
    for seed in range(20):
        runs = []
        for _ in range(2):
            torch.manual_seed(2 * seed + len(runs))  # torch's global generator: other
            # numbers at each run, which must not matter
            runs.append(impl.rejection_sample(probs, [7, 8], torch.Generator().manual_seed(seed)))
        assert runs[0] == runs[1], f"seed {seed}: {runs[0]} then {runs[1]}"
        assert all(type(t) is int for t in runs[0]), f"ids {runs[0]!r}: Python ints"


@pytest.mark.ex07b
def test_the_first_token_keeps_the_target_distribution(impl):
    """20,000 trials: the first token emitted is distributed as p, whatever
    the draft; the same check catches the rule without its residual."""
    trials = 20_000
    for draft in (1, 0):  # a likely draft, an unlikely one
        freqs = first_token_frequencies(impl.rejection_sample, TOY, [draft], trials)
        assert close_to(freqs, TOY[0], trials), (draft, freqs)
        wrong = first_token_frequencies(no_residual, TOY, [draft], trials)
        assert not close_to(wrong, TOY[0], trials), "the check must catch a missing residual"


@pytest.mark.ex07b
def test_after_an_accepted_draft_the_next_row_decides(impl):
    """Two drafts: given the first is accepted, the second token is
    distributed as row 1 (the model's distribution after the first draft)."""
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3], [0.2, 0.2, 0.6]])
    gen, seconds, trials = torch.Generator().manual_seed(7), torch.zeros(3), 0
    for _ in range(20_000):
        tokens = impl.rejection_sample(probs, [1, 2], gen)
        assert 1 <= len(tokens) <= 3
        if tokens[0] == 1:
            seconds[tokens[1]] += 1
            trials += 1
    assert close_to(seconds / trials, probs[1], trials), seconds / trials


@pytest.mark.ex07b
def test_one_hot_rows_are_greedy_and_a_seed_replays(impl):
    """One-hot rows (greedy): drafts equal to the argmax are all accepted
    with a bonus; the first mismatch emits the argmax and stops."""
    argmax = [2, 0, 3, 1]
    one_hot = torch.nn.functional.one_hot(torch.tensor(argmax), 5).float()  # (k + 1, vocab)
    gen = torch.Generator().manual_seed(0)
    assert impl.rejection_sample(one_hot, [2, 0, 3], gen) == [2, 0, 3, 1]
    assert impl.rejection_sample(one_hot, [2, 4, 3], gen) == [2, 0]
    assert impl.rejection_sample(one_hot, [4, 0, 3], gen) == [2]
    assert greedy_verify(argmax, [2, 4, 3]) == [2, 0]
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(3)), -1)
    runs = [impl.rejection_sample(probs, [7, 8, 9], torch.Generator().manual_seed(11))
            for _ in range(2)]
    assert runs[0] == runs[1]


# ----------------------------------------------------------- the proposer
def test_ngram_proposer():
    proposer = NgramProposer(3, prompt_lookup_max=3, prompt_lookup_min=2)
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2]) == [3, 4, 5]  # "1 2" seen at 0
    assert proposer.propose([1, 2, 9, 1, 2, 7, 7, 1, 2]) == [7, 7, 1]  # the most recent
    assert proposer.propose([5, 6, 7, 8]) == []  # no match: nothing
    assert proposer.propose([1, 2, 3, 4, 1, 2], max_tokens=1) == [3]
    assert proposer.propose([4, 4, 4, 4]) == [4, 4, 4]  # an overlapping copy goes on
    assert proposer.propose([5, 1, 2, 1, 2]) == [1, 2, 1]  # past the end: period 2
    assert NgramProposer(2, 4, 1).propose([3, 9, 3]) == [9, 3]  # down to one token
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}).prompt_lookup_min == 5
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.parse('{"method": "eagle", "num_speculative_tokens": 2}')
    with pytest.raises(ValueError, match="unknown"):
        SpeculativeConfig.parse({"num_speculative_tokens": 2, "lookahead": 3})


# ------------------------------------------------------------- the engine
def run(engine, prompts: dict[str, list[int]], params: SamplingParams, on_step=None) -> dict:
    return run_all(engine, prompts, params, on_step)


def check_accounting(engine) -> None:
    """After every step: a decoding sequence has its tokens but the last
    computed and no block past its end, and each block it registered in
    the prefix cache holds its own tokens (no rejected draft was hashed)."""
    bm = engine.block_manager
    for seq in engine.scheduler.running:
        assert seq.num_computed_tokens <= seq.num_tokens - 1
        assert len(seq.block_table) <= bm.blocks_needed(seq.num_tokens)
        for j in range(seq.num_registered_blocks):
            block = bm.blocks[seq.block_table[j]]
            assert block.token_ids == tuple(seq.token_ids[j * bm.block_size:
                                                          (j + 1) * bm.block_size])


@pytest.fixture(scope="module")
def prompt_set(embedded):
    return {f"p{i}": apply_chat_template(embedded.tokenizer, m)
            for i, m in enumerate(PROMPT_SET)}


def test_greedy_with_speculation_equals_without(embedded, prompt_set):
    """The course's 32 prompts, greedy: the same tokens with drafts as
    without, and every block back on the free list at the end."""
    plain = run(make_engine(embedded), prompt_set, greedy(48))
    engine = make_engine(embedded, speculative_config=SPEC, enable_prefix_caching=True)
    spec = run(engine, prompt_set, greedy(48), on_step=check_accounting)
    for key in prompt_set:
        assert spec[key].token_ids == plain[key].token_ids, key
        assert spec[key].text == plain[key].text and spec[key].finish_reason == plain[key].finish_reason
    stats = engine.snapshot()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == \
        stats["spec_decode_num_accepted_tokens"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_under_preemption_and_when_every_draft_is_wrong(embedded, prompt_set):
    """A cache too small for the batch (preemptions), drafts that are always
    wrong (all rejected, all rolled back): still the same greedy tokens."""
    prompts = dict(list(prompt_set.items())[:12])
    plain = run(make_engine(embedded), prompts, greedy(40))
    engine = make_engine(embedded, num_blocks=40, speculative_config=SPEC,
                         enable_prefix_caching=True)
    spec = run(engine, prompts, greedy(40), on_step=check_accounting)
    assert engine.scheduler.num_preemptions > 0
    assert {k: v.token_ids for k, v in spec.items()} == {k: v.token_ids for k, v in plain.items()}
    wrong = make_engine(embedded, speculative_config=SPEC, enable_prefix_caching=True)
    wrong.scheduler.proposer.propose = lambda token_ids, max_tokens, k: [0] * min(k, max_tokens)
    spec = run(wrong, prompts, greedy(40), on_step=check_accounting)
    assert {k: v.token_ids for k, v in spec.items()} == {k: v.token_ids for k, v in plain.items()}
    stats = wrong.snapshot()
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_num_accepted_tokens"] == 0
    assert wrong.block_manager.num_free_blocks == wrong.block_manager.num_blocks


def test_stops_inside_an_accepted_run(embedded):
    """max_tokens, a stop token id and a stop string that fall inside a run
    of accepted drafts stop at the right token, as without speculation."""
    ids = apply_chat_template(embedded.tokenizer, [{"role": "user", "content": REPEAT}])
    plain = run(make_engine(embedded), {"x": ids}, greedy(64))["x"]
    later = plain.token_ids[20]
    cases = {"max": greedy(23), "stop_id": greedy(64, stop_token_ids=[later]),
             "stop_str": greedy(64, stop=[plain.text[40:46]])}
    for name, params in cases.items():
        want = run(make_engine(embedded), {name: ids}, params)[name]
        engine = make_engine(embedded, speculative_config=SPEC)
        emitted = record_tokens_per_step(engine)
        got = run(engine, {name: ids}, params)[name]
        assert emitted[-1] > 1, (name, emitted)  # the last step accepted drafts
        assert (got.token_ids, got.text, got.finish_reason) == \
            (want.token_ids, want.text, want.finish_reason), name


def record_tokens_per_step(engine) -> list[int]:
    """The tokens the rejection sampler gave at each step (one sequence)."""
    emitted, update = [], engine.scheduler.update_from_output

    def recording(batch, sampled):
        emitted.extend(len(tokens) for tokens in sampled.values())
        return update(batch, sampled)

    engine.scheduler.update_from_output = recording
    return emitted


def test_penalties_logprobs_grammar_and_seeds_with_speculation(embedded):
    """Greedy with penalties (drafts count as output), logprobs and a
    grammar: the same as without speculation. Seeded sampling replays."""
    ids = apply_chat_template(embedded.tokenizer, [{"role": "user", "content": REPEAT}])
    schema = {"type": "object", "properties": {"fruits": {"type": "array", "items": {
        "type": "string", "maxLength": 10}, "maxItems": 12}}, "required": ["fruits"]}
    cases = {
        "penalties": greedy(48, repetition_penalty=1.3, presence_penalty=0.5,
                            frequency_penalty=0.3, logprobs=2),
        "grammar": greedy(96, structured_outputs=StructuredOutputsParams(json=schema)),
        "min_tokens": greedy(24, min_tokens=20)}
    for name, params in cases.items():
        want = run(make_engine(embedded, structured_outputs=True), {name: ids}, params)[name]
        got = run(make_engine(embedded, structured_outputs=True, speculative_config=SPEC),
                  {name: ids}, params)[name]
        assert got.token_ids == want.token_ids, name
        if params.logprobs is not None:
            for a, b in zip(got.logprobs, want.logprobs):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=48)
    runs = [run(make_engine(embedded, speculative_config=SPEC), {"s": ids}, seeded)["s"]
            for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids


def test_offline_llm_takes_a_speculative_config(embedded):
    """vLLM's offline spelling: LLM(speculative_config={...})."""
    from common.entrypoints.llm import LLM
    llm = LLM(loaded=embedded, speculative_config=SPEC, device_memory_gb=2.0)
    assert llm.engine.config.speculative_config == SpeculativeConfig.parse(SPEC)
    messages = [{"role": "user", "content": REPEAT}]
    out = llm.chat(messages, greedy(32), use_tqdm=False)[0].outputs[0]
    plain = LLM(loaded=embedded, device_memory_gb=2.0).chat(messages, greedy(32),
                                                            use_tqdm=False)[0].outputs[0]
    assert out.token_ids == plain.token_ids
    assert llm.engine.snapshot()["spec_decode_num_accepted_tokens"] > 0
    from common.config import ConfigError
    with pytest.raises(ConfigError, match="continuous batching"):
        make_engine(embedded, policy="static", speculative_config=SPEC)  # ch03-04


def test_a_batch_size_schedule_sets_k(embedded, prompt_set):
    """vLLM's num_speculative_tokens_per_batch_size: up to 4 drafts while 3
    sequences or fewer run, 1 from 4 on; the tokens stay greedy's."""
    prompts = dict(list(prompt_set.items())[:6])
    plain = run(make_engine(embedded), prompts, greedy(40))
    spec = {**SPEC, "num_speculative_tokens_per_batch_size": [[1, 3, 4], [4, 64, 1]]}
    engine = make_engine(embedded, speculative_config=spec)
    asked, propose = [], engine.scheduler.proposer.propose

    def recording(token_ids, max_tokens=None, k=None):
        asked.append((len(engine.scheduler.running), k))
        return propose(token_ids, max_tokens, k)

    engine.scheduler.proposer.propose = recording
    got = run(engine, prompts, greedy(40))
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in plain.items()}
    assert {k for n, k in asked if n >= 4} == {1} and {k for n, k in asked if n <= 3} == {4}
    with pytest.raises(ValueError, match="schedule"):
        SpeculativeConfig.parse({"num_speculative_tokens": 2,
                                 "num_speculative_tokens_per_batch_size": [[1, 8, 3]]})


class CountingScheduler(ContinuousScheduler):
    """A learner's scheduler: chapter 05's, counting the steps it scheduled."""

    def schedule(self):
        self.num_scheduled = getattr(self, "num_scheduled", 0) + 1
        return super().schedule()


def test_drafts_go_on_the_scheduler_a_learner_hands_in(embedded):
    """`with_drafts` keeps the scheduler class it is given (never chapter
    05's in its place): the engine's scheduler is the learner's class with
    drafts, it runs every step, drafts are accepted and the tokens stay
    greedy's. The parts still pickle (chapter 09's engine processes)."""
    import pickle
    from dataclasses import replace

    from common.engine.parts import EngineParts
    from common.spec_decode.speculative import DraftScheduling, with_drafts
    from tests.components import Components

    ids = apply_chat_template(embedded.tokenizer, [{"role": "user", "content": REPEAT}])
    want = run(make_engine(embedded), {"x": ids}, greedy(32))["x"]
    engine = make_engine(embedded, impl=replace(Components(), ContinuousScheduler=CountingScheduler),
                         speculative_config=SPEC)
    assert isinstance(engine.scheduler, CountingScheduler)
    assert isinstance(engine.scheduler, DraftScheduling)
    got = run(engine, {"x": ids}, greedy(32))["x"]
    assert got.token_ids == want.token_ids
    assert engine.scheduler.num_scheduled > 0
    assert engine.snapshot()["spec_decode_num_accepted_tokens"] > 0
    parts = with_drafts(EngineParts(scheduler_cls=CountingScheduler),
                        SpeculativeConfig.parse(SPEC))
    assert pickle.loads(pickle.dumps(parts)) == parts
