"""The pictures (pictures/make/pictures.py, `make pictures`): every PNG of
pictures/ is drawn from its data file as it is now, a changed data file
or a stray PNG is reported, drawing is deterministic, and the traces are
the engine's: no block both free and used, ref counts that match the
block tables, each chapter's policy visible in its steps."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pictures.make import pictures

pytestmark = pytest.mark.slides
DATA = pictures.DATA_DIR
TRACES = {path.stem.removeprefix("kv-trace-"): json.loads(path.read_text())
          for path in sorted(DATA.glob("kv-trace-*.json"))}


def test_every_picture_is_drawn_from_its_data_as_it_is_now() -> None:
    problems = pictures.stale_pictures()
    assert not problems, "\n".join(problems)


def test_every_data_file_feeds_a_picture() -> None:
    fed = {name for names, _ in pictures.PICTURES.values() for name in names}
    assert sorted(p.name for p in DATA.glob("*.json")) == sorted(fed)


# ------------------------------------------------------ planted changes
def _copy(root: Path) -> Path:
    """pictures/ (PNGs and data) in a scratch folder."""
    shutil.copytree(pictures.PICTURES_DIR, root / "pictures")
    return root / "pictures"


def test_a_data_file_changed_without_redraw_is_reported(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    path = copy / "data" / "kv-trace-ch05.json"
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle] = ord("7") if data[middle] != ord("7") else ord("8")  # one byte
    path.write_bytes(bytes(data))
    problems = pictures.stale_pictures(copy)
    assert [p.split(":")[0] for p in problems] == ["pictures/kv-pool-ch05.png",
                                                   "pictures/timeline-ch04-vs-ch05.png"]
    assert all("changed since it was drawn" in p for p in problems)


def test_a_png_without_its_data_is_reported(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    shutil.copy(copy / "card.png", copy / "stray.png")
    (copy / "data" / "card.json").unlink()
    (copy / "kv-pool-ch03.png").unlink()
    assert pictures.stale_pictures(copy) == [
        "pictures/stray.png: no data file draws it (not in PICTURES)",
        "pictures/kv-pool-ch03.png: not drawn (make pictures)",
        "pictures/card.png: its data file is missing: pictures/data/card.json",
        "pictures/card-ch02.png: its data file is missing: pictures/data/card.json"]


def test_drawing_twice_gives_the_same_bytes(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    shutil.copy(DATA / "engine-map.json", tmp_path / "data")
    first = pictures.draw("engine-map-ch04.png", tmp_path).read_bytes()
    second = pictures.draw("engine-map-ch04.png", tmp_path).read_bytes()
    assert first == second
    assert pictures.png_stamp(tmp_path / "engine-map-ch04.png") == \
        pictures.data_stamp(["engine-map.json"], tmp_path / "data")


# ----------------------------------------------- the traces are the engine's
@pytest.mark.parametrize("name", sorted(TRACES))
def test_no_block_is_both_free_and_used(name: str) -> None:
    trace = TRACES[name]
    blocks = set(range(trace["engine"]["num_blocks"]))
    for step in trace["steps"]:
        used = {b for table in step["tables"].values() for b in table}
        free = set(step["free"])
        assert not used & free, f"step {step['step']}: {sorted(used & free)} free and used"
        assert used | free == blocks, f"step {step['step']}: blocks neither free nor used"


@pytest.mark.parametrize("name", sorted(TRACES))
def test_ref_counts_and_tables_agree(name: str) -> None:
    trace = TRACES[name]
    size = trace["engine"]["block_size"]
    for step in trace["steps"]:
        readers: dict[int, int] = {}
        for table in step["tables"].values():
            for block in table:
                readers[block] = readers.get(block, 0) + 1
        assert step["shared"] == sorted([b, n] for b, n in readers.items() if n > 1)
        for rid, table in step["tables"].items():
            assert len(table) * size >= step["tokens"][rid]  # its tokens fit its blocks
        assert {rid for rid, *_ in step["batch"]} <= set(step["running"])
        assert not set(step["waiting"]) & set(step["running"])


def test_the_same_load_and_colours_in_every_pool() -> None:
    pools = [TRACES[name] for name in ("ch03", "ch04", "ch05")]
    assert all(t["requests"] == pools[0]["requests"] and t["load"] == pools[0]["load"]
               for t in pools)
    for trace in pools:
        for step in trace["steps"]:
            for rid in step["tables"]:
                assert pictures.request_colour(trace["requests"], rid) == \
                    pictures.request_colour(pools[0]["requests"], rid)
    colours = [pictures.request_colour(pools[0]["requests"], r["id"])
               for r in pools[0]["requests"]]
    assert len(set(colours)) == len(colours)


def test_each_chapter_policy_shows_in_its_trace() -> None:
    assert max(len(s["running"]) for s in TRACES["ch03"]["steps"]) == 1  # one at a time
    before: list[str] = []
    for step in TRACES["ch04"]["steps"]:  # static: a batch joins only once the last one left
        joined = set(step["running"]) - set(before)
        assert not joined or not set(before) & set(step["running"]), step["step"]
        before = step["running"]
    ch05 = TRACES["ch05"]["steps"]
    assert max(len(s["running"]) for s in ch05) > 4  # continuous: all at once
    assert any(s["shared"] for s in ch05)  # the system prompt's block, shared
    preemption = TRACES["preemption"]["steps"]
    assert preemption[-1]["preemptions"] >= 1
    assert any(kind == "recompute" for s in preemption for _, kind, *_ in s["batch"])


def test_the_engine_map_names_files_that_exist() -> None:
    layout = json.loads((DATA / "engine-map.json").read_text())
    missing = [b["file"] for b in layout["boxes"] if not (pictures.ROOT / b["file"]).exists()]
    assert not missing
    assert sorted({b["chapter"] for b in layout["boxes"]}) == pictures.CHAPTERS
    assert sorted(layout["chapters"]) == pictures.CHAPTERS


def test_the_card_names_results_files_that_exist() -> None:
    card = json.loads((DATA / "card.json").read_text())
    for source in card["sources"].values():
        assert (pictures.ROOT / source.split(" ")[0]).exists(), source
    for bar in card["bars"]:
        used = bar["weights_mib"] + bar["activations_mib"] + bar["kv_mib"]
        assert used <= card["budget_mib"]
