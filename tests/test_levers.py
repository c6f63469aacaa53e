"""`make levers` (bench/experiments/levers.py): each lever's engine is built
as a server builds it, on the demo card, and measured; its perplexity comes
from a model of its own. A tiny load: speed is never asserted here."""
import pytest

from bench.experiments import levers

pytestmark = pytest.mark.bench


def test_float32_and_int4_fit_the_demo_card_and_are_measured():
    load = levers.Load(clients=2, max_tokens=2, card_gb=1.1)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    rows = []
    for lever in ("float32", "int4"):
        rows.append(levers.measure(lever, load, prompts))
        levers.measure_perplexity(lever, load, rows[-1])
    levers.add_comparisons(rows)
    float32, int4 = rows
    assert float32["kv_blocks"] == 537  # the demo card, float32 (chapter 02's arithmetic)
    assert int4["kv_blocks"] > float32["kv_blocks"] and int4["weights_mib"] < 200
    assert all(len(t) == 2 for row in rows for t in row["tokens"])
    assert 20 < float32["perplexity"] < 40 and 20 < int4["perplexity"] < 40
    assert float32["agreement_prefix"] == 1.0
