"""The import budget: each chapter loads its own and earlier chapters' modules, no more.

Each chapter's server.py runs with its default flags in a fresh
interpreter and answers one chat request; from chapter 05 on, the
chapter's offline `LLM` generates too (tests/check_imports.py). Every
module of `common` it loaded must belong to that chapter or an earlier
one (`MODULE_CHAPTERS`, common/entrypoints/chapters.py), and so must the
libraries that a chapter brings in: xgrammar (07), ZeroMQ, msgpack and
Ray (09). Chapter 08 with its default flags never loads its
tensor-parallel worker processes (they come with
`--tensor-parallel-size` above 1: tests/test_tensor_parallel.py).

The same table makes the README's chapter table: the test checks that the
README shows what it generates.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from common.entrypoints.chapters import (CHAPTER_FOLDERS, FLAG_CHAPTERS, MODULE_CHAPTERS,
                                         module_chapter)
from tests.check_imports import loaded_modules, over_budget, page_block, readme_table

pytestmark = pytest.mark.layout

ROOT = Path(__file__).resolve().parents[1]
ENGINE_PROCESS = {"common.engine.core", "common.engine.core_client", "common.engine.serial"}
SPECULATION = {"common.spec_decode.speculative", "common.spec_decode.ngram_proposer",
               "common.layers.rejection_sampler"}


def modules_on_disk() -> set[str]:
    names = set()
    for path in (ROOT / "common").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_module_of_common_has_a_chapter():
    assert set(MODULE_CHAPTERS) == modules_on_disk()
    assert set(MODULE_CHAPTERS.values()) <= set(CHAPTER_FOLDERS)


@pytest.mark.parametrize("chapter", sorted(CHAPTER_FOLDERS))
def test_a_chapter_loads_no_later_chapter(chapter):
    modules = loaded_modules(chapter)
    assert over_budget(chapter, modules) == []
    if chapter < "09":
        assert not {"zmq", "msgpack", "ray"} & set(modules)
        assert not ENGINE_PROCESS & set(modules)
    if chapter < "07":
        assert "xgrammar" not in modules and not SPECULATION & set(modules)
    assert "common.worker.tp_workers" not in modules  # default flags: one rank
    if chapter >= "03":  # the engine's own parts are really there
        assert "common.engine.llm_engine" in modules


def test_the_budget_check_sees_a_later_chapters_module():
    assert over_budget("05", ["common.engine.core", "common.core.scheduler"]) == [
        "common.engine.core: chapter 09's"]
    assert over_budget("03", ["common.nowhere"]) == ["common.nowhere: not in MODULE_CHAPTERS"]
    assert module_chapter("xgrammar") == "07"


def test_the_readme_chapter_table_comes_from_the_budget_table():
    assert readme_table() in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("chapter", sorted(CHAPTER_FOLDERS))
def test_each_chapter_page_lists_the_modules_the_table_gives_it(chapter):
    text = (ROOT / CHAPTER_FOLDERS[chapter] / "README.md").read_text()
    assert page_block(chapter) in text, "python -m tests.check_imports --write-pages"


def test_each_engine_map_box_has_its_modules_chapter_or_says_what_switches_it_on():
    """The engine map (pictures/data/engine-map.json) names each box's file
    and chapter. A box of a module of `common/` has the chapter the table
    gives that module, or a later one (chapter 05's continuous batching in
    chapter 03's scheduler.py) with `switched_on_by`: a flag of that
    chapter, or a name the file defines."""
    import json
    boxes = json.loads((ROOT / "pictures/data/engine-map.json").read_text())["boxes"]
    wrong = []
    for box in boxes:
        if not box["file"].startswith("common/"):
            continue
        table = MODULE_CHAPTERS[box["file"].removesuffix(".py").replace("/", ".")]
        by = box.get("switched_on_by")
        if by is None:
            ok = box["chapter"] == table
        elif by.startswith("--"):
            ok = box["chapter"] > table and FLAG_CHAPTERS.get(by) == box["chapter"]
        else:
            ok = box["chapter"] > table and by in (ROOT / box["file"]).read_text()
        if not ok:
            wrong.append((box["id"], box["chapter"], table, by))
    assert wrong == []


# The words a summary may use for the fields of FIELD_CHAPTERS.
FIELD_WORDS = {"stop": ["stop"], "logprobs": ["logprobs"], "streaming": ["stream"],
               "penalties": ["presence_penalty", "frequency_penalty", "repetition_penalty"]}


def test_the_readme_table_gives_each_field_and_flag_to_the_chapter_that_adds_it():
    """CHAPTER_SUMMARY's words (the README's "component it adds") name a
    request field or a flag only in the chapter that FIELD_CHAPTERS or
    FLAG_CHAPTERS gives it to."""
    import re
    from common.entrypoints.chapters import CHAPTER_SUMMARY, FIELD_CHAPTERS
    wrong = []
    for chapter, (_, adds, _) in CHAPTER_SUMMARY.items():
        words = set(re.findall(r"[\w-]+", adds.replace("`", "")))
        for word in words:
            for field in FIELD_WORDS.get(word, [word] if word in FIELD_CHAPTERS else []):
                if FIELD_CHAPTERS[field] != chapter:
                    wrong.append((chapter, word, FIELD_CHAPTERS[field]))
            if f"--{word.lstrip('-')}" in FLAG_CHAPTERS and word.startswith("--") \
                    and FLAG_CHAPTERS[word] != chapter:
                wrong.append((chapter, word, FLAG_CHAPTERS[word]))
    assert wrong == []
