"""One component per chapter: each server refuses what later chapters add,
and chapters 03-06 run without chapter 07's libraries.

- every chapter's parser refuses each flag of a later chapter, by name,
  with exit 2 (common/entrypoints/chapters.py's table), and each
  server.py does so before it loads the model;
- every chapter's app answers a later chapter's request field with a 400
  naming the chapter that adds it, and serves the fields it has;
- chapter 07's server.py is the first to name the grammar step and the
  speculation modules (what each chapter really loads is the import
  budget's: tests/test_import_budget.py).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from bench.loadtest import CHAPTERS, ROOT
from common.engine.async_llm import AsyncLLM
from common.entrypoints.api_server import build_app
from common.entrypoints.chat_server import build_engine_chat_app
from common.entrypoints.chapters import FIELD_CHAPTERS, FLAG_CHAPTERS
from common.entrypoints.cli_args import api_server_parser, parse_server_args, server_parser
from common.entrypoints.simple_app import Completion, build_chat_app
from tests.engine_helpers import make_engine

ALL = sorted(CHAPTERS)  # "01" .. "10"
FLAG_VALUES = {"--block-size": ["8"], "--enable-prefix-caching": [],
               "--long-prefill-token-threshold": ["64"], "--enforce-eager": [],
               "--disable-cascade-attn": [],
               "--api-key": ["secret"], "--max-waiting": ["4"], "--disable-fastapi-docs": [],
               "--enable-server-load-tracking": [], "--enable-tokenizer-info-endpoint": [],
               "--max-logprobs": ["30"], "--enable-prompt-tokens-details": [],
               "--speculative-config": ['{"method": "ngram", "num_speculative_tokens": 2}'],
               "--quantization": ["int8"], "--tensor-parallel-size": ["2"],
               "--live-view": [], "--record-events": ["/tmp/steps.jsonl"],
               "--kv-events-config": ['{"enable_kv_cache_events": true}'],
               "--engine-core": ["in-process"], "--data-parallel-size": ["2"],
               "--enable-lora": [], "--lora-modules": ["a=/tmp/a"], "--max-loras": ["2"],
               "--max-lora-rank": ["8"], "--max-cpu-loras": ["2"]}
FIELD_VALUES = {"top_p": 0.5, "stop": ["."], "presence_penalty": 0.5, "frequency_penalty": 0.5,
                "logit_bias": {"11": 1.0}, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
                "min_tokens": 1, "stop_token_ids": [2], "logprobs": True, "top_logprobs": 2,
                "return_token_ids": True, "stream": True, "length_penalty": 1.5,
                "stream_options": {"include_usage": True},
                "response_format": {"type": "json_object"},
                "structured_outputs": {"choice": ["yes", "no"]}}
NEEDS = {"stream_options": {"stream": True}, "top_logprobs": {"logprobs": True}}
CHAT = [{"role": "user", "content": "Say yes or no."}]


def chapter_parser(chapter: str):
    """The parser each chapter's server builds (chapters 06-08 add the API's flags)."""
    if chapter >= "06":
        return api_server_parser(f"Chapter {chapter}", chapter)
    return server_parser(f"Chapter {chapter}", chapter)


def test_the_table_covers_every_flag_value_and_field():
    assert set(FLAG_VALUES) == set(FLAG_CHAPTERS)
    assert set(FIELD_VALUES) == set(FIELD_CHAPTERS)


@pytest.mark.parametrize("chapter", ALL)
def test_every_chapter_refuses_the_flags_of_later_chapters(chapter, capsys):
    for flag, adds in FLAG_CHAPTERS.items():
        argv = [flag, *FLAG_VALUES[flag]]
        if adds <= chapter:
            parse_server_args(chapter_parser(chapter), chapter, argv)  # its own: accepted
            continue
        with pytest.raises(SystemExit) as info:
            parse_server_args(chapter_parser(chapter), chapter, argv)
        assert info.value.code == 2, flag  # argparse's usage error
        assert (f"error: {flag} is not implemented in chapter {chapter}: chapter {adds} adds it"
                in capsys.readouterr().err), flag


API_FLAGS = ("--api-key", "--max-waiting", "--disable-fastapi-docs",
             "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint",
             "--max-logprobs", "--enable-prompt-tokens-details")


@pytest.mark.parametrize("chapter", ALL)
def test_a_chapters_help_shows_only_its_own_flags(chapter, capsys):
    with pytest.raises(SystemExit):
        chapter_parser(chapter).parse_args(["--help"])
    shown = capsys.readouterr().out
    for flag, adds in FLAG_CHAPTERS.items():
        if flag in API_FLAGS and chapter < "06":
            assert flag not in shown  # not even in its parser
        else:
            assert (flag in shown) == (adds <= chapter), (chapter, flag)


@pytest.mark.parametrize("argv, error", [
    (["--engine-core", "in-process", "-dp", "2"], "--data-parallel-size > 1 runs engines in "
                                                 "processes of their own"),
    (["--data-parallel-size", "0"], "--data-parallel-size must be at least 1")])
def test_chapter_09_refuses_flags_that_cannot_go_together(argv, error, capsys):
    with pytest.raises(SystemExit) as info:
        parse_server_args(chapter_parser("09"), "09", argv)
    assert info.value.code == 2 and error in capsys.readouterr().err


def test_later_flags_at_their_defaults_change_nothing_and_pass():
    """`make bench` passes the scheduler limits to every chapter alike."""
    parse_server_args(chapter_parser("02"), "02", [
        "--tensor-parallel-size", "1", "--no-enable-prefix-caching",
        "--max-num-seqs", "256", "--max-num-batched-tokens", "2048"])


REFUSED_AT_START = [("01", "--api-key"), ("03", "--block-size"),
                    ("04", "--long-prefill-token-threshold"), ("05", "--speculative-config"),
                    ("06", "--quantization"), ("07", "--tensor-parallel-size"),
                    ("08", "--data-parallel-size")]


def test_each_server_refuses_a_later_flag_before_loading_the_model():
    """The real server.py, as a learner starts it: exit 2 naming the chapter,
    and no model loaded first (the load would print its card line). The
    six start together: each spends its time importing torch."""
    started = {(chapter, flag): subprocess.Popen(
        [sys.executable, str(ROOT / CHAPTERS[chapter] / "server.py"), flag,
         *FLAG_VALUES[flag]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"}) for chapter, flag in REFUSED_AT_START}
    for (chapter, flag), process in started.items():
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 2, (chapter, flag, stderr[-2000:])
        adds = FLAG_CHAPTERS[flag]
        assert f"{flag} is not implemented in chapter {chapter}: chapter {adds} adds it" in stderr
        assert "KV cache" not in stdout + stderr and "card" not in stdout


# ------------------------------------------------------------ request fields
@pytest.fixture(scope="module")
def engine(embedded):
    engine = AsyncLLM(make_engine(embedded, num_blocks=32, structured_outputs=True))
    yield engine
    engine.close()


def chapter_app(chapter: str, engine):
    if chapter == "01":  # chapter 01's generate: never reached by a refused request
        return build_chat_app("Chapter 01", "m", 8192, engine.engine.tokenizer,
                              lambda ids, req, max_tokens, seed: Completion([], "stop"))
    if chapter <= "05":
        return build_engine_chat_app(f"Chapter {chapter}", engine, "m", chapter)
    return build_app(engine, "m", chapter=chapter, title=f"Chapter {chapter}")


@pytest.mark.parametrize("chapter", [c for c in ALL if c != "02"])  # 02: test_ch02_naive.py
def test_every_chapter_refuses_the_request_fields_of_later_chapters(chapter, engine):
    client = TestClient(chapter_app(chapter, engine))
    for field, adds in FIELD_CHAPTERS.items():
        if adds <= chapter:
            continue
        body = {"messages": CHAT, "max_tokens": 2, **NEEDS.get(field, {}),
                field: FIELD_VALUES[field]}
        answer = client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 400, (chapter, field, answer.text)
        error = answer.json()["error"]
        expected = next(f for f in FIELD_CHAPTERS if f in body)  # the table's first, named
        assert error["param"] == expected, (chapter, field, error)
        assert f"chapter {FIELD_CHAPTERS[expected]} adds it" in error["message"]


@pytest.mark.parametrize("chapter", ["03", "05", "06", "07", "08"])
def test_a_chapters_own_fields_are_served(chapter, engine):
    client = TestClient(chapter_app(chapter, engine))
    own = {f: v for f, v in FIELD_VALUES.items() if FIELD_CHAPTERS[f] <= chapter
           and f not in ("stream", "stream_options", "structured_outputs", "top_logprobs",
                         "logprobs", "stop_token_ids", "min_tokens", "logit_bias")}
    answer = client.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 3, "temperature": 0, **own})
    assert answer.status_code == 200, (chapter, answer.text)
    if chapter >= "07":  # the grammar held: a JSON object
        assert answer.json()["choices"][0]["message"]["content"].lstrip().startswith("{")


def test_response_format_text_is_the_default_everywhere(engine):
    """`{"type": "text"}` asks for nothing: chapter 06 serves it."""
    client = TestClient(chapter_app("06", engine))
    answer = client.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 2, "response_format": {"type": "text"}})
    assert answer.status_code == 200, answer.text


# ----------------------------------------- chapters 03-06 without chapter 07's
# What each chapter's server and offline LLM load, xgrammar and the
# speculation modules included, is the import budget's
# (tests/test_import_budget.py); here, what each server.py says.
def test_chapter_07_is_the_first_to_need_xgrammar():
    """Its server imports the grammar step at the top: without xgrammar it fails."""
    source = (ROOT / CHAPTERS["07"] / "server.py").read_text()
    assert "from common.structured_output.manager import StructuredOutputManager" in source
    for chapter in ("03", "04", "05", "06"):
        text = (ROOT / CHAPTERS[chapter] / "server.py").read_text()
        assert "structured_output" not in text and "spec_decode" not in text
