"""`make bench`: the machinery on a tiny dummy model and a tiny load.

Speed is never asserted here: only that every figure is recorded, the table
rendered and the pictures drawn, and that failures are rows, not crashes.
"""
import dataclasses
import json

import pytest
import torch

from bench import bench
from bench.loadtest import CHAPTERS

pytestmark = pytest.mark.bench
TINY = ["--model", "tiny-llama", "--load-format", "dummy"]


def test_one_chapter_and_the_peers_leave_json_table_and_figure(tmp_path, capsys):
    code = bench.main(["--preset", "quick", "--chapters", "05", "--clients", "2",
                       "--max-tokens", "4", "--peers", "--out-dir", str(tmp_path), *TINY])
    assert code == 0
    [json_path] = (tmp_path / "results").glob("*-quick.json")
    record = json.loads(json_path.read_text())
    assert {"date", "command", "duration_s", "machine", "settings", "rows"} <= set(record)
    assert {"cpu", "cores", "gpu", "torch", "transformers", "host"} <= set(record["machine"])
    assert record["settings"]["model"] == "tiny-llama"
    names = [row["name"] for row in record["rows"]]
    assert names == ["05", "hf-generate", "hf-static-batch", "hf-generate-batch"]
    for row in record["rows"]:
        assert set(bench.FIGURES) <= set(row), row["name"]
        assert (row["completed"], row["failed"], row["output_tokens"]) == (2, 0, 8), row
        assert row["output_tokens_per_s"] > 0 and row["e2e_p95_s"] > 0
    ch05 = record["rows"][0]
    assert ch05["peak_running"] >= 1 and 0 <= ch05["kv_waste_perc"] <= 100
    assert ch05["peak_kv_reserved_bytes"] >= ch05["peak_kv_used_bytes"] > 0
    assert record["rows"][-1]["ttft_p50_s"] is not None  # generate_batch timestamps
    table = json_path.with_suffix(".md").read_text()
    assert "| system | card | load |" in table and "| hf-generate-batch |" in table
    assert table in capsys.readouterr().out
    png = tmp_path / "chapters-quick.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    png.unlink()  # --redraw measures nothing and writes the same table and a figure
    assert bench.main(["--redraw", str(json_path), "--out-dir", str(tmp_path)]) == 0
    assert json_path.with_suffix(".md").read_text() == table and png.stat().st_size > 10_000


def test_chapter_02_on_the_demo_card_is_a_row_of_failures(tmp_path):
    # The two clients start together; the first holds its reservation for
    # 64 tokens, far longer than the second takes to arrive on any machine.
    settings = dataclasses.replace(bench.PRESETS["quick"], chapters=["02"], clients=[2],
                                   max_tokens=64, roomy_card_gb=1.1)
    rows = bench.run_bench(settings, tmp_path)
    [row] = rows
    assert row["status"] == "failures" and (row["completed"], row["failed"]) == (1, 1)
    assert row["first_error"].startswith("HTTP 500") and "out of memory" in row["first_error"]
    table = bench.markdown_table(rows)
    assert "**1 / 1**" in table
    bench.draw_chapters(rows, tmp_path / "failed.png", "chapter 02 on the demo card")
    assert (tmp_path / "failed.png").stat().st_size > 0


def test_missing_and_broken_servers_are_rows_not_crashes(tmp_path, monkeypatch):
    settings = dataclasses.replace(bench.PRESETS["quick"], model="tiny-llama",
                                   load_format="dummy")
    monkeypatch.setitem(CHAPTERS, "07", "07-not-written")
    [skipped] = bench.measure_chapter(bench.Entry("07", "07", clients=[2]), settings, tmp_path)
    assert skipped["status"] == "skipped" and "not written yet" in skipped["first_error"]
    # A card too small for the weights: the server exits at startup.
    tiny_card = bench.Entry("05", "05", card_gb=0.001, clients=[2])
    [broken] = bench.measure_chapter(tiny_card, settings, tmp_path)
    assert broken["status"] == "error" and "failed to start" in broken["first_error"]
    text = bench.markdown_table([skipped, broken]) + "\n".join(bench.notes([skipped, broken]))
    assert "| skipped |" in text and "| error |" in text and "failed to start" in text


def _row(name, clients, tokens_per_s, failed=0, chapter="05"):
    entry = bench.Entry(name, chapter, card_gb=1.1)
    row = bench.empty_row(entry, clients, "failures" if failed else "ok")
    row.update(completed=clients - failed, failed=failed, output_tokens_per_s=tokens_per_s,
               e2e_p95_s=2.0, e2e_p50_s=1.0)
    return row


def test_ratios_against_chapter_02_and_the_sweep_figure(tmp_path):
    rows = [_row("02", c, 0.0, failed=c - 1, chapter="02") for c in (1, 2, 4)]
    rows += [_row("02 (roomy)", c, 8.0, chapter="02") for c in (1, 2, 4)]
    rows += [_row("05", c, 8.0 * c) for c in (1, 2, 4)]
    bench.add_ratios(rows)
    assert [r["x_ch02"] for r in rows if r["name"] == "05"] == [1.0, 2.0, 4.0]
    bench.draw_sweep(rows, tmp_path / "sweep.png", "synthetic sweep")
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


def test_the_bench_plan_gives_chapter_01_a_lighter_load_and_02_two_cards():
    entries = bench.plan(bench.PRESETS["default"])
    names = [e.name for e in entries]
    assert names == ["01", "02", "02 (roomy)", "03", "04", "05", "06"]
    ch01 = entries[0]
    assert ch01.max_tokens < entries[1].max_tokens and "lighter" in ch01.note


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU machine")
def test_the_gpu_preset_says_plainly_that_it_needs_cuda(tmp_path, capsys):
    assert bench.main(["--preset", "gpu", "--out-dir", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()
