"""Structured outputs (ch07): xgrammar's token masks, in the engine and over HTTP.

The grading tests of exercise 07a (`make exercise CH=07a`) are marked ex07a:
the learner's `apply_token_bitmask` against xgrammar's own kernel, and in a
generation loop whose every answer must validate.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import requests
import torch
import xgrammar as xgr

from common.structured_output.manager import StructuredOutputManager, choice_grammar
from common.layers.token_bitmask import allocate_token_bitmask
from common.loader import apply_chat_template
from common.sampling_params import SamplingParams, StructuredOutputsParams
from tests.conftest import PROMPTS, hf_greedy, openai_client
from tests.engine_helpers import greedy, make_engine, run_all

pytestmark = pytest.mark.ch07

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"]}},
        "required": ["name", "address"]},
    "array": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"type": "string", "maxLength": 12},
                   "minItems": 1, "maxItems": 3}},
        "required": ["colors"]},
    "enum": {"type": "object", "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "confidence": {"type": "string", "enum": ["low", "high"]}},
        "required": ["answer", "confidence"]},
    "integer_range": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["age", "rating"]},
    "required_fields": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30},
        "done": {"type": "boolean"},
        "priority": {"type": "integer", "minimum": 1, "maximum": 3}},
        "required": ["title", "done", "priority"], "additionalProperties": False},
}
SEEDS = range(8)
ASK = "Answer with a JSON object about a person, a place or a task."


def chat_ids(tokenizer, text: str) -> list[int]:
    return apply_chat_template(tokenizer, [{"role": "user", "content": text}])


@pytest.fixture(scope="module")
def engine(embedded):
    return make_engine(embedded, structured_outputs=True)


# --------------------------------------------------- exercise 07a: the mask
@pytest.mark.ex07a
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_disallowed_token_gets_minus_inf_in_place(impl, dtype):
    """The logits themselves are changed (the function returns None): a
    token whose bit is 0 gets -inf, not 0 or a large negative number (a
    penalty that a large logit would still beat); every other logit keeps
    its value exactly. Row 0 allows nothing (words of 0), row 1 all (-1)."""
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(dtype) * 30
    bitmask = torch.tensor([[0, 0], [-1, -1], [0, -1], [-1, 0]], dtype=torch.int32)
    before = logits.clone()
    assert impl.apply_token_bitmask(logits, bitmask) is None, "mask in place, return nothing"
    assert torch.isneginf(logits[0]).all(), (
        f"a row whose words are 0 allows no token: every logit -inf, got {logits[0, :4]}")
    assert torch.isneginf(logits[2, :32]).all() and torch.isneginf(logits[3, 32:]).all(), (
        "a word of 0 allows none of its 32 tokens: every logit -inf")
    kept = ~torch.isneginf(logits)
    assert torch.equal(logits[kept], before[kept]), "an allowed logit keeps its value exactly"
    assert kept[1].any() and kept[2, 32:].any() and kept[3, :32].any(), (
        "the words of -1 allow their tokens: those logits must stay")


@pytest.mark.ex07a
def test_the_sign_bit_is_token_31_of_its_word(impl):
    """Bit 31 of an int32 word is its sign: a word with it set is negative.
    The word -2**31 | 1 (bits 0 and 31) allows tokens 0 and 31 of its 32,
    and no other: shifting right copies the sign bit in from the left, so
    each shifted word needs its lowest bit alone (`& 1`)."""
    word = -2 ** 31 | 1
    bitmask = torch.tensor([[word, 0], [0, word]], dtype=torch.int32)
    logits = torch.zeros(2, 64)
    impl.apply_token_bitmask(logits, bitmask)
    allowed = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert allowed == [[0, 31], [32, 63]], (
        f"allowed tokens {allowed}, expected [[0, 31], [32, 63]]")


@pytest.mark.ex07a
@pytest.mark.parametrize("vocab", [33, 100])
def test_the_last_words_padding_is_ignored(impl, vocab):
    """A vocabulary that is not a multiple of 32: the last word has bits
    for tokens that do not exist; the mask is cut to the logits' vocab
    columns. Row 0 allows every token (words of -1), row 1 all but those of
    the last word (a last word of 0)."""
    words = -(-vocab // 32)
    bitmask = torch.full((2, words), -1, dtype=torch.int32)
    bitmask[1, -1] = 0
    logits = torch.zeros(2, vocab)
    impl.apply_token_bitmask(logits, bitmask)
    assert logits.shape == (2, vocab)
    blocked = [torch.isneginf(row).nonzero().flatten().tolist() for row in logits]
    last_word = list(range(32 * (words - 1), vocab))
    assert blocked == [[], last_word], (
        f"tokens set to -inf: {blocked}, expected [[], {last_word}]")


@pytest.mark.ex07a
@pytest.mark.parametrize("vocab", [49152, 100, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_token_bitmask_equals_xgrammars_kernel(impl, vocab, dtype):
    """Random masks, every bit pattern (the sign bit too): the same -inf as xgrammar's."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    bitmask = torch.randint(-2 ** 31, 2 ** 31, (5, -(-vocab // 32)), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1  # every token allowed
    bitmask[1] = 0  # none
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, backend="torch_native")
    ours = logits.clone()
    assert impl.apply_token_bitmask(ours, bitmask) is None  # in place, as xgrammar's
    assert torch.equal(ours, expected)
    assert torch.isinf(ours[1]).all() and torch.equal(ours[0], logits[0])


@pytest.mark.ex07a
def test_a_masked_generation_loop_always_validates(impl, embedded):
    """The learner's mask in a plain generation loop (no engine), sampled at
    temperature 1: every answer parses and validates against its schema."""
    manager = StructuredOutputManager(embedded.tokenizer, embedded.model.config.vocab_size,
                                      [embedded.tokenizer.eos_token_id])
    schema = SCHEMAS["enum"]
    prompt = chat_ids(embedded.tokenizer, "Is Paris in France? Answer as JSON.")
    for seed in range(3):
        grammar = manager.grammar_for(StructuredOutputsParams(json=schema))
        gen, ids, out = torch.Generator().manual_seed(seed), list(prompt), []
        for _ in range(60):
            with torch.inference_mode():
                logits = embedded.model(torch.tensor([ids])).logits[:, -1].float()  # (1, vocab)
                bitmask = allocate_token_bitmask(1, logits.shape[-1])
                grammar.fill_bitmask(bitmask, 0)
                impl.apply_token_bitmask(logits, bitmask)
            token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen))
            assert grammar.accept_token(token), "the mask let through a token the grammar refuses"
            if token == embedded.tokenizer.eos_token_id:
                break
            ids.append(token)
            out.append(token)
        jsonschema.validate(json.loads(embedded.tokenizer.decode(out)), schema)


# ------------------------------------------------------------- the engine
def constrained(seed: int | None = None, max_tokens: int = 200, temperature: float = 1.0,
                **structured) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**structured))


def test_every_sampled_answer_validates(engine, embedded):
    """Five kinds of schema x 8 seeds at temperature 1, in one batch."""
    prompt = chat_ids(embedded.tokenizer, ASK)
    for name, schema in SCHEMAS.items():
        for seed in SEEDS:
            engine.add_request(f"{name}-{seed}", prompt, constrained(seed, json=schema))
    done = run_all(engine)
    for name, schema in SCHEMAS.items():
        for seed in SEEDS:
            out = done[f"{name}-{seed}"]
            assert out.finish_reason == "stop", (name, seed, out.text)
            jsonschema.validate(json.loads(out.text), schema)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_json_object_choice_regex_and_grammar(engine, embedded):
    prompt = chat_ids(embedded.tokenizer, "Say something.")
    choices = ("yes", "no", 'a "quoted" \\ choice')
    for seed in range(4):
        engine.add_request(f"object-{seed}", prompt, constrained(seed, json_object=True))
        engine.add_request(f"choice-{seed}", prompt, constrained(seed, choice=choices))
        engine.add_request(f"regex-{seed}", prompt,
                           constrained(seed, regex=r"[A-Z][a-z]{2,8}-[0-9]{3}"))
        engine.add_request(f"grammar-{seed}", prompt, constrained(
            seed, grammar='root ::= "(" [0-9]+ (" + " [0-9]+)* ")"'))
    done = run_all(engine)
    for seed in range(4):
        assert isinstance(json.loads(done[f"object-{seed}"].text), dict)
        assert done[f"choice-{seed}"].text in choices
        assert re.fullmatch(r"[A-Z][a-z]{2,8}-[0-9]{3}", done[f"regex-{seed}"].text)
        assert re.fullmatch(r"\([0-9]+( \+ [0-9]+)*\)", done[f"grammar-{seed}"].text)
    assert json.loads(choice_grammar(("a", 'b"'))[len("root ::= "):].split(" | ")[1]) == 'b"'


def test_unconstrained_rows_in_a_mixed_batch_stay_hfs_greedy(engine, embedded):
    """Constrained and free requests share every step; the free ones' greedy
    tokens are HF's, token for token."""
    prompts = [apply_chat_template(embedded.tokenizer, p) for p in PROMPTS]
    for i, ids in enumerate(prompts):
        engine.add_request(f"free-{i}", ids, greedy(24))
        engine.add_request(f"json-{i}", ids, constrained(i, json=SCHEMAS["enum"]))
    done = run_all(engine)
    for i, ids in enumerate(prompts):
        assert done[f"free-{i}"].token_ids == hf_greedy(embedded.model, ids, 24)
        jsonschema.validate(json.loads(done[f"json-{i}"].text), SCHEMAS["enum"])


def test_preemption_chunked_prefill_prefix_caching_and_n(embedded):
    """A small cache (preemptions), 16-token steps (chunked prefill), prefix
    caching, several samples of one prompt: every answer still validates."""
    engine = make_engine(embedded, structured_outputs=True, num_blocks=24,
                         max_num_batched_tokens=16,
                         enable_prefix_caching=True)
    prompt = chat_ids(embedded.tokenizer, ASK)
    schema = SCHEMAS["nested"]
    for seed in range(6):
        engine.add_request(f"s{seed}", prompt, constrained(seed, json=schema, max_tokens=120))
    done = run_all(engine)
    assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small"
    assert engine.snapshot()["prefix_cache_hits"] > 0
    for seed in range(6):
        assert done[f"s{seed}"].finish_reason == "stop"
        jsonschema.validate(json.loads(done[f"s{seed}"].text), schema)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_eos_only_where_the_grammar_may_end(engine, embedded):
    """A schema no answer of max_tokens can satisfy ends at the length, as in
    vLLM; a greedy constrained answer ends with EOS only once complete."""
    prompt = chat_ids(embedded.tokenizer, "Write a long sentence.")
    long_string = {"type": "object", "properties": {"text": {"type": "string", "minLength": 80}},
                   "required": ["text"]}
    engine.add_request("short", prompt, constrained(json=long_string, max_tokens=8,
                                                     temperature=0))
    engine.add_request("enough", prompt, constrained(json=SCHEMAS["enum"], temperature=0))
    done = run_all(engine)
    assert done["short"].finish_reason == "length" and len(done["short"].token_ids) == 8
    with pytest.raises(json.JSONDecodeError):
        json.loads(done["short"].text)
    assert done["enough"].finish_reason == "stop"
    assert done["enough"].token_ids[-1] in engine.eos_token_ids  # EOS, once accepting


def test_a_bad_grammar_is_refused_before_it_runs(engine):
    from common.structured_output.manager import GrammarError
    with pytest.raises(GrammarError, match="regex"):
        engine.check_request(5, constrained(regex="[0-9]{3"))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=("a",))


# ---------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def server(start_server):
    """Chapter 06 with both features on."""
    return start_server("07", "--speculative-config",
                        '{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')


def post(server, body: dict, path: str = "/v1/chat/completions") -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=120)


def test_openai_client_response_format_and_parse(server):
    from pydantic import BaseModel
    client = openai_client(server.url)

    class City(BaseModel):
        name: str
        country: str
        population: int

    messages = [{"role": "user", "content": "Describe Paris as JSON."}]
    schema = {"name": "city", "schema": City.model_json_schema(), "strict": True}
    for seed in range(3):
        answer = client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=120, seed=seed,
            response_format={"type": "json_schema", "json_schema": schema})
        City.model_validate_json(answer.choices[0].message.content)
    if hasattr(client, "beta") and hasattr(client.beta.chat.completions, "parse"):
        parsed = client.beta.chat.completions.parse(
            model="smollm2", messages=messages, max_tokens=120, response_format=City, seed=1)
        assert isinstance(parsed.choices[0].message.parsed, City)
    text = client.completions.create(model="smollm2", prompt="Is the sky blue? Answer:",
                                     max_tokens=5, extra_body={"structured_outputs": {
                                         "choice": ["yes", "no"]}})
    assert text.choices[0].text in ("yes", "no")
    obj = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=150,
                                         seed=3, response_format={"type": "json_object"}, n=2)
    assert all(isinstance(json.loads(c.message.content), dict) for c in obj.choices)


def test_curl_shaped_request_validates_and_bad_ones_name_their_param(server):
    schema = SCHEMAS["integer_range"]
    body = {"messages": [{"role": "user", "content": "A person as JSON."}], "max_tokens": 80,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": schema}}}
    answer = post(server, body)
    assert answer.status_code == 200, answer.text
    jsonschema.validate(json.loads(answer.json()["choices"][0]["message"]["content"]), schema)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    bad = [({"response_format": {"type": "json_schema", "json_schema": {
                "name": "p", "schema": {"type": "objekt"}}}}, "response_format.json_schema.schema"),
           ({"response_format": {"type": "yaml"}}, "response_format.type"),
           ({"response_format": {"type": "json_schema"}}, "response_format"),
           ({"response_format": {"type": "json_object", "strict": True}}, "response_format"),
           ({"response_format": {"type": "json_schema", "json_schema": {
               "name": "p", "schema": {}, "strict": "yes"}}}, "response_format.json_schema.strict"),
           ({"response_format": {"type": "json_schema", "json_schema": {
               "name": "bad name!", "schema": {}}}}, "response_format.json_schema.name"),
           ({"structured_outputs": {"regex": "[0-9]{3"}}, "structured_outputs"),
           ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
           ({"structured_outputs": {"choice": ["a"]},
             "response_format": {"type": "json_object"}}, "structured_outputs")]
    for extra, param in bad:
        response = post(server, {**chat, **extra})
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == param, (extra, response.text)
    assert post(server, {**chat, "response_format": {"type": "text"}}).status_code == 200


def test_speculative_metrics_on_metrics_and_stats(server):
    """The server runs with --speculative-config: a request that copies its
    prompt gets drafts accepted, counted under vLLM's names."""
    from tests.test_speculative import REPEAT
    answer = post(server, {"messages": [{"role": "user", "content": REPEAT}], "max_tokens": 48,
                           "temperature": 0})
    assert answer.status_code == 200, answer.text
    stats = requests.get(server.url + "/stats", timeout=10).json()
    assert 0 < stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_acceptance_rate"] == pytest.approx(
        stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_draft_tokens"])
    metrics = requests.get(server.url + "/metrics", timeout=10).text
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total",
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="smollm2",'
                 'position="0"}', "vllm:spec_decode_draft_acceptance_rate"):
        assert name in metrics, name
