"""One component per chapter: each server refuses what later chapters add,
and chapters 03-06 run without chapter 07's libraries.

- every chapter's parser refuses each flag of a later chapter, by name,
  with exit 2 (common/entrypoints/chapters.py's table), and each
  server.py does so before it loads the model;
- every chapter's app answers a later chapter's request field with a 400
  naming the chapter that adds it, and serves the fields it has;
- the engines of chapters 03, 04, 05 and 06 build and generate with
  `import xgrammar` made to fail, and without importing the speculation
  modules; chapter 07's server is the first to need them.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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

ALL = sorted(CHAPTERS)  # "01" .. "09"
FLAG_VALUES = {"--block-size": ["8"], "--enable-prefix-caching": [],
               "--long-prefill-token-threshold": ["64"], "--enforce-eager": [],
               "--api-key": ["secret"], "--max-waiting": ["4"], "--disable-fastapi-docs": [],
               "--enable-server-load-tracking": [], "--enable-tokenizer-info-endpoint": [],
               "--speculative-config": ['{"method": "ngram", "num_speculative_tokens": 2}'],
               "--quantization": ["int8"], "--tensor-parallel-size": ["2"],
               "--live-view": [], "--record-events": ["/tmp/steps.jsonl"],
               "--kv-events-config": ['{"enable_kv_cache_events": true}'],
               "--engine-core": ["in-process"], "--data-parallel-size": ["2"]}
# What a flag needs beside it from chapter 09 on (the live view watches an
# engine in the server's own process).
ALONGSIDE_FROM_09 = {"--live-view": ["--engine-core", "in-process"]}
FIELD_VALUES = {"top_p": 0.5, "stop": ["."], "presence_penalty": 0.5, "frequency_penalty": 0.5,
                "logit_bias": {"11": 1.0}, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
                "min_tokens": 1, "stop_token_ids": [2], "logprobs": True, "top_logprobs": 2,
                "return_token_ids": True, "stream": True,
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
        if chapter >= "09":
            argv += ALONGSIDE_FROM_09.get(flag, [])
        if adds <= chapter:
            parse_server_args(chapter_parser(chapter), chapter, argv)  # its own: accepted
            continue
        with pytest.raises(SystemExit) as info:
            parse_server_args(chapter_parser(chapter), chapter, argv)
        assert info.value.code == 2, flag  # argparse's usage error
        assert (f"error: {flag} is not implemented in chapter {chapter}: chapter {adds} adds it"
                in capsys.readouterr().err), flag


API_FLAGS = ("--api-key", "--max-waiting", "--disable-fastapi-docs",
             "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint")


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
    (["--live-view"], "--live-view watches an engine in the server's own process: "
                      "add --engine-core in-process"),
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


# ------------------------------------------------- chapters 03-06 without xgrammar
NO_XGRAMMAR = textwrap.dedent("""
    import runpy, sys
    sys.modules["xgrammar"] = None  # `import xgrammar` now raises ImportError
    try:
        import xgrammar  # noqa: F401
        raise SystemExit("xgrammar imported")
    except ImportError:
        pass
    from fastapi.testclient import TestClient
    from common.config import EngineConfig
    from common.engine.async_llm import AsyncLLM
    from common.engine.parts import assemble_engine
    from common.core.scheduler import ContinuousScheduler, StaticScheduler
    from common.entrypoints.api_server import build_app, build_engine_chat_app
    from common.loader import load_model
    from common.sampling_params import SamplingParams
    for folder in sys.argv[1:]:  # chapters 03-06's server.py import, nothing more
        runpy.run_path(f"{folder}/server.py", run_name="not_main")
    loaded = load_model("smollm2", "float32", "cpu")
    engines = {
        "03": dict(scheduler_cls=StaticScheduler, config=EngineConfig(
            dtype="float32", block_size=None, max_num_seqs=1, device_memory_gb=2.0)),
        "04": dict(scheduler_cls=StaticScheduler, config=EngineConfig(
            dtype="float32", enable_prefix_caching=True, device_memory_gb=2.0)),
        "05": dict(scheduler_cls=ContinuousScheduler, config=EngineConfig(
            dtype="float32", enable_prefix_caching=True, device_memory_gb=2.0))}
    for chapter, parts in engines.items():  # chapter 03's blocks hold 8,192 tokens each
        engine = assemble_engine(parts["config"], scheduler_cls=parts["scheduler_cls"],
                           loaded=loaded, num_blocks=2 if chapter == "03" else 16)
        engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=4))
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
        assert len(done[0].outputs[0].token_ids) == 4, chapter
        print("engine", chapter, "ok")
    engine = AsyncLLM(assemble_engine(engines["05"]["config"], loaded=loaded, num_blocks=16))
    for chapter, app in (("05", build_engine_chat_app("ch05", engine, "m", "05")),
                         ("06", build_app(engine, "m", chapter="06"))):
        answer = TestClient(app).post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert answer.status_code == 200, answer.text
        print("server", chapter, "ok")
    engine.close()
    loaded_later = [m for m in ("xgrammar", "common.structured_output.manager",
                                "common.spec_decode.speculative", "common.spec_decode.ngram_proposer",
                                "common.layers.rejection_sampler", "common.layers.token_bitmask")
                    if sys.modules.get(m) is not None]
    assert loaded_later == [], loaded_later
    print("no chapter 07 module imported")
""")


def test_chapters_03_to_06_build_and_generate_without_xgrammar():
    folders = [str(ROOT / CHAPTERS[c]) for c in ("03", "04", "05", "06")]
    done = subprocess.run([sys.executable, "-c", NO_XGRAMMAR, *folders], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    for chapter in ("03", "04", "05"):
        assert f"engine {chapter} ok" in done.stdout
    assert "server 06 ok" in done.stdout and "no chapter 07 module imported" in done.stdout


def test_chapter_07_is_the_first_to_need_xgrammar():
    """Its server imports the grammar step at the top: without xgrammar it fails."""
    source = (ROOT / CHAPTERS["07"] / "server.py").read_text()
    assert "from common.structured_output.manager import StructuredOutputManager" in source
    for chapter in ("03", "04", "05", "06"):
        text = (ROOT / CHAPTERS[chapter] / "server.py").read_text()
        assert "structured_output" not in text and "spec_decode" not in text
