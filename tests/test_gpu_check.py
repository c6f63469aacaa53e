"""The GPU check runs end to end without a GPU, saying so, and writes each
step's file as it finishes."""
import json

import pytest
import torch

from bench.gpu import gpu_check

pytestmark = pytest.mark.bench
STEPS = ["demo", "correctness", "throughput", "graphs", "decode-kernel"]
NAME = "2026-12-07-gpu-check"  # the files' names


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")
def test_without_cuda_every_step_is_skipped_and_the_files_are_written(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path), "--name", NAME]) == 0
    record = json.loads((tmp_path / f"{NAME}.json").read_text())
    assert [s["name"] for s in record["steps"]] == STEPS  # priority order
    assert all(s["status"] == "skipped" and "no CUDA" in s["detail"] for s in record["steps"])
    assert {"gpu", "driver", "torch", "triton", "cuda", "cpu"} <= set(record["machine"])
    for number, name in enumerate(STEPS, start=1):  # one file per step
        step = json.loads((tmp_path / f"{NAME}-{number:02d}-{name}.json").read_text())["step"]
        assert step["name"] == name and step["status"] == "skipped"
        assert (tmp_path / f"{NAME}-{number:02d}-{name}.md").read_text().startswith(
            f"# GPU check, step {name}: skipped")
    table = (tmp_path / f"{NAME}.md").read_text()
    assert "| demo | skipped |" in table and table in capsys.readouterr().out
    assert "bf16" in table  # the CPU's bf16 support, as every results file


def test_the_first_runs_files_still_render_as_committed():
    """The 2026-12-04 run's records (four steps, one file) render unchanged."""
    from pictures.make.figures import RESULTS, rendered
    for stem in ("2026-12-04-gpu-check", "2026-12-04-gpu-check-rerun"):
        assert rendered(RESULTS / f"{stem}.json") == (RESULTS / f"{stem}.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")
def test_steps_run_in_priority_order_whatever_order_they_are_named(tmp_path):
    gpu_check.main(["--out", str(tmp_path), "--name", NAME, "--steps", "decode-kernel", "demo"])
    record = json.loads((tmp_path / f"{NAME}.json").read_text())
    assert [s["name"] for s in record["steps"]] == ["demo", "decode-kernel"]
    assert not (tmp_path / f"{NAME}-02-correctness.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")
def test_a_step_that_overruns_its_limit_is_stopped_and_its_file_says_so(tmp_path, monkeypatch):
    """A step's process stopped at its limit: its file still exists, failed."""
    monkeypatch.setattr(gpu_check, "run_command", lambda command, timeout: (None, "partial log"))
    step = gpu_check.run_in_own_process("graphs", tmp_path, NAME, 5.0, gpu_check.machine())
    assert step.status == "failed" and "timed out" in step.detail
    saved = json.loads((tmp_path / f"{NAME}-04-graphs.json").read_text())["step"]
    assert saved["status"] == "failed" and saved["log_tail"] == "partial log"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")
def test_the_correctness_step_rehearses_greedy_equality_on_the_cpu(tmp_path):
    """--rehearse runs the step's own code on the CPU (the kernels need CUDA)."""
    assert gpu_check.main(["--out", str(tmp_path), "--name", NAME, "--rehearse",
                           "--steps", "correctness", "decode-kernel"]) == 0
    record = json.loads((tmp_path / f"{NAME}.json").read_text())
    steps = {s["name"]: s for s in record["steps"]}
    assert steps["correctness"]["status"] == "ok", steps["correctness"]
    assert steps["correctness"]["figures"]["tiny-llama eager"] == "equal"
    assert "needs CUDA" in steps["correctness"]["figures"]["kernels"]
    assert steps["decode-kernel"]["status"] == "skipped"
    assert "not rehearsed" in steps["decode-kernel"]["detail"]
