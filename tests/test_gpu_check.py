"""The one-shot GPU check runs end to end without a GPU, saying so."""
import json

import pytest
import torch

from bench.gpu import gpu_check

pytestmark = pytest.mark.bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")
def test_without_cuda_every_step_is_skipped_and_the_files_are_written(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path), "--budget-s", "60"]) == 0
    record = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [s["name"] for s in record["steps"]] == ["kernels", "equivalence", "demo", "bench"]
    assert all(s["status"] == "skipped" and "no CUDA" in s["detail"] for s in record["steps"])
    assert {"gpu", "driver", "torch", "triton", "cuda"} <= set(record["machine"])
    table = (tmp_path / "gpu-check.md").read_text()
    assert "| kernels | skipped |" in table and table in capsys.readouterr().out
