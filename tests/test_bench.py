"""`make bench`: the machinery on a tiny dummy model and a tiny load.

Speed is never asserted here: only that every figure is recorded, the table
rendered and the pictures drawn, and that failures are rows, not crashes.
"""
import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
import torch

from bench import bench, measure, plot, presets, table
from bench.loadtest import CHAPTERS, prompt_messages
from bench.peers import llamacpp
from common.net import free_port

pytestmark = pytest.mark.bench
TINY = ["--model", "tiny-llama", "--load-format", "dummy"]


def test_one_chapter_and_the_peers_leave_json_table_and_figure(tmp_path, capsys):
    code = bench.main(["--preset", "quick", "--chapters", "05", "--clients", "2",
                       "--max-tokens", "4", "--peers", "--out-dir", str(tmp_path), *TINY])
    assert code == 0
    [json_path] = (tmp_path / "results").glob("*-quick-*.json")  # some chapters: a label
    record = json.loads(json_path.read_text())
    assert {"date", "command", "duration_s", "machine", "settings", "rows"} <= set(record)
    assert {"cpu", "cores", "gpu", "torch", "transformers", "host"} <= set(record["machine"])
    assert record["settings"]["model"] == "tiny-llama"
    names = [row["name"] for row in record["rows"]]
    assert names == ["05", "vLLM 0.32.0 float32", "vLLM 0.32.0 bfloat16", "llama.cpp f32",
                     "hf-generate", "hf-static-batch", "hf-generate-batch"]
    for _ in range(3):  # the bench's model is not the one vLLM and llama.cpp run
        peer = record["rows"].pop(1)
        assert peer["status"] == "skipped" and "embedded model only" in peer["first_error"]
    for row in record["rows"]:
        assert set(measure.FIGURES) <= set(row), row["name"]
        assert (row["completed"], row["failed"], row["output_tokens"]) == (2, 0, 8), row
        assert row["output_tokens_per_s"] > 0 and row["e2e_p95_s"] > 0
    ch05 = record["rows"][0]
    assert ch05["peak_running"] >= 1 and 0 <= ch05["kv_waste_perc"] <= 100
    assert ch05["kv_room_tokens"] > 0 and ch05["requests_that_fit"] > 0
    assert "## The chapter ladder" not in json_path.with_suffix(".md").read_text()  # one chapter
    assert ch05["peak_kv_reserved_bytes"] >= ch05["peak_kv_used_bytes"] > 0
    assert record["rows"][-1]["ttft_p50_s"] is not None  # generate_batch timestamps
    written = json_path.with_suffix(".md").read_text()
    assert "| system | card | load |" in written and "| hf-generate-batch |" in written
    assert written in capsys.readouterr().out
    png = tmp_path / "chapters-quick-ch05.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    png.unlink()  # --redraw measures nothing and writes the same table and a figure
    assert bench.main(["--redraw", str(json_path), "--out-dir", str(tmp_path)]) == 0
    assert json_path.with_suffix(".md").read_text() == written and png.stat().st_size > 10_000


def test_chapter_02_on_the_demo_card_is_a_row_of_failures(tmp_path):
    # The two clients start together; the first holds its reservation for
    # 64 tokens, far longer than the second takes to arrive on any machine.
    settings = dataclasses.replace(presets.PRESETS["quick"], chapters=["02"], clients=[2],
                                   max_tokens=64, roomy_card_gb=1.1)
    rows = measure.run_bench(settings, tmp_path)
    [row] = rows
    assert row["status"] == "failures" and (row["completed"], row["failed"]) == (1, 1)
    assert row["first_error"].startswith("HTTP 500") and "out of memory" in row["first_error"]
    assert "**1 / 1**" in table.markdown_table(rows)
    plot.draw_chapters(rows, tmp_path / "failed.png", "chapter 02 on the demo card")
    assert (tmp_path / "failed.png").stat().st_size > 0


def test_missing_and_broken_servers_are_rows_not_crashes(tmp_path, monkeypatch):
    settings = dataclasses.replace(presets.PRESETS["quick"], model="tiny-llama",
                                   load_format="dummy")
    monkeypatch.setitem(CHAPTERS, "07", "07-not-written")
    [skipped] = measure.measure_chapter(presets.Entry("07", "07", clients=[2]), settings, tmp_path)
    assert skipped["status"] == "skipped" and "not written yet" in skipped["first_error"]
    # A card too small for the weights: the server exits at startup.
    tiny_card = presets.Entry("05", "05", card_gb=0.001, clients=[2])
    [broken] = measure.measure_chapter(tiny_card, settings, tmp_path)
    assert broken["status"] == "error" and "failed to start" in broken["first_error"]
    text = table.markdown_table([skipped, broken]) + "\n".join(table.notes([skipped, broken]))
    assert "| skipped |" in text and "| error |" in text and "failed to start" in text


def _row(name, clients, tokens_per_s, failed=0, chapter="05"):
    entry = presets.Entry(name, chapter, card_gb=1.1)
    row = measure.empty_row(entry, clients, "failures" if failed else "ok")
    row.update(completed=clients - failed, failed=failed, output_tokens_per_s=tokens_per_s,
               e2e_p95_s=2.0, e2e_p50_s=1.0)
    return row


def test_ratios_against_chapter_02_and_the_sweep_figure(tmp_path):
    rows = [_row("02", c, 0.0, failed=c - 1, chapter="02") for c in (1, 2, 4)]
    rows += [_row("02 (roomy)", c, 8.0, chapter="02") for c in (1, 2, 4)]
    rows += [_row("05", c, 8.0 * c) for c in (1, 2, 4)]
    measure.add_ratios(rows)
    assert [r["x_ch02"] for r in rows if r["name"] == "05"] == [1.0, 2.0, 4.0]
    plot.draw_sweep(rows, tmp_path / "sweep.png", "synthetic sweep")
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    roomy_failed = [_row("02", 4, 10.0, failed=3, chapter="02"), _row("05", 4, 50.0)]
    measure.add_ratios(roomy_failed)  # a chapter 02 row with failures is no baseline
    assert roomy_failed[1]["x_ch02"] is None


def test_x_vllm_pairs_each_row_with_the_vllm_row_of_its_dtype():
    def peer(dtype, tokens_per_s):
        entry = presets.Entry(f"vLLM {dtype}", peer=presets.VLLM, dtype=dtype)
        row = measure.empty_row(entry, 32, "ok")
        row.update(completed=32, failed=0, output_tokens_per_s=tokens_per_s)
        return row
    ours = [_row("06", 32, 90.0), _row("06 bfloat16", 32, 300.0)]
    ours[0]["dtype"], ours[1]["dtype"] = "float32", "bfloat16"
    rows = ours + [peer("float32", 100.0), peer("bfloat16", 200.0)]
    measure.add_vllm_ratios(rows)
    assert [r["x_vllm"] for r in rows] == [0.9, 1.5, 1.0, 1.0]
    settings = bench.settings_from_args(bench.parser().parse_args(
        ["--peers", "vllm", "--chapters", "02", "05", "06"]))
    assert settings.levers == ["bfloat16"]  # chapter 06 beside vLLM's bfloat16 row
    assert presets.run_label(settings) == "-ch02-05-06-vllm"
    assert presets.figure_name(settings) == "chapters-ch02-05-06-vllm.png"
    assert [e.name for e in presets.plan(settings)][-2:] == ["vLLM 0.32.0 float32",
                                                             "vLLM 0.32.0 bfloat16"]


def test_the_bench_plan_gives_chapter_01_a_lighter_load_and_02_two_cards():
    entries = presets.plan(presets.PRESETS["default"])
    names = [e.name for e in entries]
    assert names == ["01", "02", "02 (roomy)", "03", "04, 1 seq", "04", "05, no prefix cache",
                     "05", "06"]
    ch01 = entries[0]
    assert ch01.max_tokens < entries[1].max_tokens and "lighter" in ch01.note


def test_each_ladder_row_changes_one_thing_from_the_row_above():
    """Chapters 03-06 on the same card and load; each row's flags or
    chapter differ from the row above's in one place."""
    entries = [e for e in presets.plan(presets.PRESETS["default"]) if e.change]
    assert {(e.card_gb, tuple(e.clients), e.requests, e.max_tokens) for e in entries} == {
        (1.1, (16,), 2, 64)}
    steps = [(e.chapter, tuple(e.server_flags)) for e in entries]
    assert steps == [("03", ()), ("04", ("--max-num-seqs", "1")), ("04", ()),
                     ("05", ("--no-enable-prefix-caching",)), ("05", ()), ("06", ())]
    for (chapter, flags), (above_chapter, above_flags) in zip(steps[1:], steps):
        assert (chapter != above_chapter) + (flags != above_flags) >= 1
        assert chapter == above_chapter or not flags or not above_flags


def test_the_ladder_prices_each_change_against_the_row_above(tmp_path):
    rows = [_row(step.name, 16, tps, chapter=step.chapter)
            for step, tps in zip(presets.LADDER, [20.0, 20.0, 100.0, 150.0, 160.0, 150.0])]
    for row, step in zip(rows, presets.LADDER):
        row.update(change=step.change, moves=step.moves, kv_room_tokens=8192,
                   prefix_cache_hit_rate=0.5)
    rows.insert(0, _row("02 (roomy)", 16, 10.0, chapter="02"))
    measure.add_ratios(rows)
    measure.add_ladder_ratios(rows)
    assert [r["x_above"] for r in rows] == [None, None, 1.0, 5.0, 1.5, 160 / 150, 150 / 160]
    text = "\n".join(table.ladder_table(rows))
    assert "| 04, 1 seq | paging alone" in text and "| 5.00x |" in text
    assert "row 06 serves 15.0x chapter 02's" in text and "up to 24 times" in text
    plot.draw_ladder(rows, tmp_path / "ladder.png", "synthetic ladder")
    assert (tmp_path / "ladder.png").stat().st_size > 10_000


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU machine")
def test_the_gpu_preset_says_plainly_that_it_needs_cuda(tmp_path, capsys):
    assert bench.main(["--preset", "gpu", "--out-dir", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()


# ------------------------------------------------- servers that are not ours
def test_a_running_server_at_a_url_is_one_more_row(start_server, tmp_path):
    """`--url`: the same load over HTTP on a server the bench did not start
    (here chapter 05, which does not stream: the row falls back to whole
    answers and says so), named by --url-name or by the server's model id."""
    server = start_server("05", "tiny-llama", "--load-format", "dummy", "--dtype", "float32")
    code = bench.main(["--preset", "quick", "--chapters", "none", "--url", server.url,
                       "--url-name", "by-url", "--url", server.url, "--clients", "2",
                       "--max-tokens", "4", "--out-dir", str(tmp_path), *TINY])
    assert code == 0
    [json_path] = (tmp_path / "results").glob("*-quick-*.json")  # some chapters: a label
    rows = json.loads(json_path.read_text())["rows"]
    assert [row["name"] for row in rows] == ["by-url", "tiny-llama"]  # 2nd: /v1/models
    for row in rows:
        assert (row["system"], row["url"], row["status"]) == ("url", server.url, "ok")
        assert (row["completed"], row["failed"], row["output_tokens"]) == (2, 0, 8)
        assert row["stream"] is False and "whole answers" in row["note"]
        assert row["peak_kv_used_bytes"] > 0  # our server has /stats
    written = json_path.with_suffix(".md").read_text()
    assert "| by-url | - | 2x1x4 |" in written and "a running server at" in written


class _NoExtrasServer(BaseHTTPRequestHandler):
    """A strict OpenAI-like server: `ignore_eos` is an unknown field (400),
    it never streams, and its answers stop at EOS after 3 tokens."""

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # http.server calls it so
        self._send(200, {"object": "list", "data": [{"id": "strict-model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if "ignore_eos" in body:
            self._send(400, {"error": {"message": "Unrecognized request argument "
                                       "supplied: ignore_eos", "param": None}})
            return
        assert body["model"] == "strict-model"
        tokens = min(3, body["max_tokens"])
        self._send(200, {"choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": "Paris."}}],
                         "usage": {"prompt_tokens": 30, "completion_tokens": tokens,
                                   "total_tokens": 30 + tokens}})

    def log_message(self, *args):  # quiet
        pass


def test_a_server_that_refuses_ignore_eos_is_loaded_without_it_and_the_row_says_so(tmp_path):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _NoExtrasServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        settings = dataclasses.replace(presets.PRESETS["quick"], chapters=[], urls=[url],
                                       clients=[2], max_tokens=4)
        [row] = measure.run_bench(settings, tmp_path)
    finally:
        httpd.shutdown()
    assert (row["name"], row["status"], row["completed"]) == ("strict-model", "ok", 2)
    assert row["output_tokens"] == 6  # what `usage` reports, not 2 x max_tokens
    assert "refused ignore_eos" in row["note"] and "whole answers" in row["note"]
    assert "answers shorter than asked: 6 of 8 tokens" in row["note"]


def test_the_llama_cpp_row_says_how_to_build_it_and_the_bench_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp, "BINARY", tmp_path / "no-llama-server")
    settings = dataclasses.replace(presets.PRESETS["quick"], chapters=[], clients=[2],
                                   peers=[presets.LLAMACPP])
    [row] = measure.run_bench(settings, tmp_path)
    assert (row["name"], row["status"]) == ("llama.cpp f32", "skipped")
    assert "make llama-server" in row["first_error"]
    assert "make llama-server" in "\n".join(table.notes([row]))


def test_peers_and_urls_from_the_command_line():
    def settings(*argv):
        return bench.settings_from_args(bench.parser().parse_args(list(argv)))
    assert settings("--peers").peers == presets.ALL_PEERS
    assert settings("--peers", "llama-cpp").peers == ["llama-cpp"]
    assert settings().peers == [] and settings("--chapters", "none").chapters == []
    s = settings("--url", "http://a:1/", "--url", "http://b:2", "--url-name", "vllm",
                 "--llamacpp-dtype", "bf16", "--peers", "llama-cpp")
    names = [e.name for e in presets.plan(s) if e.chapter is None]
    assert names == ["vllm", "b:2", "llama.cpp bf16"]


def test_levers_are_chapter_06_rows_with_their_flags():
    def settings(*argv):
        return bench.settings_from_args(bench.parser().parse_args(list(argv)))
    assert settings("--levers").levers == ["int8", "int4"]
    s = settings("--chapters", "05", "--levers", "int4", "tp3", "--card", "1.1")
    levers = [e for e in presets.plan(s) if e.server_flags and not e.change]  # not the ladder's
    assert [(e.name, e.chapter, e.card_gb) for e in levers] == [("08 int4", "08", 1.1),
                                                                ("08 tp3", "08", 1.1)]
    args = measure.server_args(s, 1.1) + levers[1].server_flags
    assert args[-2:] == ["--tensor-parallel-size", "3"]


@pytest.mark.skipif(llamacpp.missing() is not None, reason="llama-server is not built "
                    "(make llama-server)")
def test_llama_server_runs_the_same_prompts_through_the_gguf_chat_template(tmp_path):
    """With the binary built: the llama.cpp row is measured, and llama.cpp
    tokenizes our prompts through the chat template to the very ids our
    chapters feed their engine."""
    from common.loader import apply_chat_template, load_model
    settings = dataclasses.replace(presets.PRESETS["quick"], chapters=[], clients=[2],
                                   max_tokens=4, peers=[presets.LLAMACPP])
    [row] = measure.run_bench(settings, tmp_path)
    assert (row["status"], row["completed"], row["output_tokens"]) == ("ok", 2, 8), row
    assert llamacpp.build_info()["llama_cpp_commit"] in row["note"]
    tokenizer = load_model("smollm2", dtype="float32", device="cpu").tokenizer
    with llamacpp.LlamaServer("f32", free_port(), 1, 4, tmp_path / "l.log") as server:
        for i in range(3):
            answer = requests.post(server.url + "/v1/chat/completions", timeout=120, json={
                "messages": prompt_messages(i), "max_tokens": 1, "temperature": 0}).json()
            ids = apply_chat_template(tokenizer, prompt_messages(i))
            assert answer["usage"]["prompt_tokens"] == len(ids)


def test_requests_that_fit_are_the_blocks_over_one_requests_blocks():
    paged = {"num_blocks": 537, "block_size": 16, "prompt_tokens": 35 * 32 + 36}
    assert measure.requests_that_fit(paged, {"prompt_tokens": 36}, 32, 64) == 76  # 7 blocks each
    region = {"num_blocks": 1, "block_size": 8192, "prompt_tokens": 35 * 32}
    assert measure.requests_that_fit(region, {}, 32, 64) == 1
    assert measure.requests_that_fit(region, {}, 0, 64) is None


def test_the_fault_table_counts_what_overlapped_each_fault_and_says_never():
    """bench/faults.py's parts that need no servers: which requests a
    fault's window counts, a condition never met within its bound, and the
    table's row for it."""
    from bench.faults import Load, Outcome, markdown, seconds_until
    load = Load.__new__(Load)  # its threads aside: only the outcomes
    load.outcomes = [Outcome(0, 1, "whole"), Outcome(2, 5, "error event"),
                     Outcome(4, 6, "whole"), Outcome(7, 8, "HTTP 503")]
    assert load.overlapping(3, 6.5) == {"error event": 1, "whole": 1}
    assert seconds_until(lambda: False, bound=0.05) is None
    assert seconds_until(lambda: True) < 1
    record = {"date": "d", "command": "python -m bench.faults", "clients": 6, "max_tokens": 48,
              "settle_s": 3.0, "machine": {"cpu": "cpu", "cores": 2, "cpu_bf16": []},
              "faults": [{"fault": "replica stopped", "seen_by": "the router", "seen_s": None,
                          "client_got": "", "other": "", "peers": "p",
                          "load": {"whole": 2, "error event": 1}}]}
    row = markdown(record).splitlines()[-1]
    assert row.startswith("| replica stopped | the router | never | - | 1 error event, 2 whole")


def test_the_serve_profile_puts_each_sample_of_each_thread_in_its_part():
    """py-spy's raw lines (thread, then the stack from its root): the first
    frame from the top that a rule names decides the part."""
    from bench.profiles.serve_profile import sample_threads
    engine = ("thread (7): engine-loop;Thread.run (/usr/lib/python3.11/threading.py:982);"
              "AsyncLLM._loop (/r/common/engine/async_llm.py:330)")
    main = "thread (5): MainThread;<module> (/r/06-openai-server/server.py:30)"
    lines = [
        f"{engine};LLMEngine.step (/r/common/engine/llm_engine.py:90);"
        "Sampler.forward (/r/common/layers/sampler.py:50) 7",
        f"{engine};ModelRunner.execute_model (/r/common/worker/model_runner.py:80);"
        "LlamaModel.forward (/r/common/models/llama.py:10) 30",
        f"{engine};Event.wait (/usr/lib/python3.11/threading.py:629);"
        "Condition.wait (/usr/lib/python3.11/threading.py:327) 4",
        f"{main};EpollSelector.select (/usr/lib/python3.11/selectors.py:468) 20",
        f"{main};StreamingResponse.stream_response (/v/starlette/responses.py:250) 5",
        f"{main};mystery (/r/elsewhere.py:1) 1",
    ]
    threads = sample_threads(lines)
    assert threads["engine"] == {"sampling": 7, "forward pass": 30, "waiting for work": 4}
    assert threads["main"] == {"idle in select": 20, "HTTP and streaming": 5, "other": 1}
