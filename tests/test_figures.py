"""Every figure from its results file (pictures/make/figures.py): each results
markdown is what its JSON renders to, each measured figure on a page is in a
results file its section names, each quoted sample is in its samples file;
and a number changed in a results file makes these fail."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pictures.make import figures

pytestmark = pytest.mark.slides
ROOT = figures.ROOT
PAGES = figures.pages()


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_results_markdown_is_what_its_json_renders() -> None:
    stale = figures.stale_results()
    assert not stale, "\n".join(stale)


@pytest.mark.parametrize("page", PAGES, ids=[_name(p) for p in PAGES])
def test_every_figure_is_in_its_results_file(page: Path) -> None:
    problems = (figures.stale_tables(page) + figures.unsourced(page)
                + figures.misquoted(page))
    assert not problems, f"{len(problems)} figure(s) without their file:\n" + "\n".join(problems)


def test_not_measured_entries_are_still_on_their_pages() -> None:
    """An excuse for a figure that is gone would excuse the next one."""
    stale = [f"{page}: {piece!r}" for page, pieces in figures.NOT_MEASURED.items()
             for piece in pieces if piece not in (ROOT / page).read_text()]
    assert not stale, "\n".join(stale)


# ------------------------------------------------------ planted changes
def _copy(root: Path) -> Path:
    """The README and every bench results file, in a scratch repository."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "README.md", root / "README.md")
    shutil.copytree(figures.RESULTS, root / "bench" / "results")
    return root


def _plant(node, number: str, factor: float, name: str = "") -> int:
    """Scale every leaf of a JSON record that a page could quote as `number`."""
    changed = 0
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in list(items):
        key_name = key if isinstance(key, str) else name
        if isinstance(value, (dict, list)):
            changed += _plant(value, number, factor, key_name)
        elif (isinstance(value, float)
              and figures._held(number, figures.leaf_values(value, key_name))):
            node[key] = value * factor
            changed += 1
    return changed


def _readme_throughputs(root: Path) -> list[figures.Figure]:
    found = [f for f in figures.figures(root / "README.md", root)
             if f.unit.endswith("tok/s") and any(s.suffix == ".md" for s in f.sources)]
    assert found, "the README quotes no tok/s figure from a results file"
    return found


def test_a_changed_measurement_fails_the_page(tmp_path: Path) -> None:
    """A re-measured number (JSON and markdown both changed, as a new run
    writes them) makes the page that quotes the old one fail."""
    for index in range(len(_readme_throughputs(ROOT))):
        root = _copy(tmp_path / str(index))  # one change at a time
        figure = _readme_throughputs(root)[index]
        number = figure.numbers[-1]
        for json_path in {source.with_suffix(".json") for source in figure.sources}:
            record = json.loads(json_path.read_text())
            if _plant(record, number, 1.5):  # in every file the section names
                json_path.write_text(json.dumps(record))
                json_path.with_suffix(".md").write_text(figures.renderer(record)(record))
        problems = figures.unsourced(root / "README.md", root)
        assert any(f"{figure.line}: {figure.text!r}" in p and number in p for p in problems), \
            f"README.md:{figure.line} {figure.text} still passes:\n" + "\n".join(problems)


@pytest.mark.parametrize("planted_in", [".json", ".md"])
def test_a_number_changed_in_one_of_the_pair_fails(tmp_path: Path, planted_in: str) -> None:
    root = _copy(tmp_path)
    figure = _readme_throughputs(root)[0]
    number, source = figure.numbers[-1], figure.sources[0]
    assert figures.stale_results(root / "bench" / "results") == []
    if planted_in == ".json":
        record = json.loads(source.with_suffix(".json").read_text())
        assert _plant(record, number, 1.5)
        source.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    else:
        text = source.read_text()
        assert number in text
        source.write_text(text.replace(number, str(figures._value(number) + 1), 1))
    assert any(source.name in p for p in figures.stale_results(root / "bench" / "results"))


def test_a_misquoted_sample_fails(tmp_path: Path) -> None:
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    (results / "2026-01-01-vm-samples.md").write_text(
        "```\nAvg prompt throughput: 224.6 tokens/s, Running: 32 reqs\n```\n")
    page = tmp_path / "page.md"
    page.write_text("From `bench/results/2026-01-01-vm-samples.md`:\n\n```\n"
                    "Avg prompt throughput: 224.6 tokens/s, ...\nRunning: 31 reqs\n```\n")
    problems = figures.misquoted(page, tmp_path)
    assert problems == ["page.md:5: not in bench/results/2026-01-01-vm-samples.md: "
                        "'Running: 31 reqs'"]


def test_a_generated_table_follows_its_results_file(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    source = next(
        p for p in (root / "bench" / "results").glob("*.json")
        if f"<!-- table from bench/results/{p.name}" in (root / "README.md").read_text())
    assert figures.stale_tables(root / "README.md", root) == []
    record = json.loads(source.read_text())
    row = next(r for r in record["rows"] if r["name"] == "05")  # a row the README shows
    row["output_tokens_per_s"] *= 1.5
    source.write_text(json.dumps(record))
    assert figures.stale_tables(root / "README.md", root) != []


# ------------------------------------------------------ Source: lines
TAUGHT = figures.taught_pages()


@pytest.mark.parametrize("page", TAUGHT, ids=[_name(p) for p in TAUGHT])
def test_results_paths_and_dates_only_on_source_lines(page: Path) -> None:
    """Teaching sentences carry no dates and no results paths: each section
    that quotes a run names its files on one `Source:` line, its last."""
    problems = figures.stray_sources(page)
    assert not problems, f"{len(problems)} stray source(s):\n" + "\n".join(problems)


def test_the_source_lint_catches_a_stray_path_or_date(tmp_path: Path) -> None:
    page = tmp_path / "README.md"
    page.write_text(
        "# A\n\n"
        "Measured 2026-12-02 on a 2-core CPU: 11.8 tok/s.\n"
        "<!-- table from bench/results/2026-12-02-vm.json: rows 02 -->\n"
        "Source: [bench/results/2026-12-02-vm.md](bench/results/2026-12-02-vm.md)\n\n"
        "# B\n\n"
        "See bench/results/2026-12-01-vm.md for more.\n\n"
        "```\nls results/measured-2026-12-02.json\n```\n\n"
        "# C\n\n"
        "Source: bench/results/2026-12-02-vm.md\n"
        "Source: bench/results/2026-12-01-vm.md\n\n"
        "# D\n\n"
        "Source: bench/results/2026-12-02-vm.md\n"
        "and a sentence after it.\n")
    found = [p.split(": ", 1)[1] for p in figures.stray_sources(page, tmp_path)]
    assert found == [
        "date outside the Source: line: 2026-12-02",
        "results path outside the Source: line: bench/results/2026-12-01-vm.md",
        "date outside the Source: line: 2026-12-01",
        "results path outside the Source: line: results/measured-2026-12-02.json",
        "a second Source: line in one section",
        "the Source: line is not the last line of its section",
    ], found


def test_a_section_takes_its_files_from_its_source_line(tmp_path: Path) -> None:
    """A figure is checked against the files its section's `Source:` line
    names, not against a file named elsewhere in the section; a number
    changed in the named file fails the page."""
    root = _copy(tmp_path)
    source = root / "bench" / "results" / "2026-12-02-vm.md"
    page = root / "chapter" / "README.md"
    page.parent.mkdir()
    page.write_text("# Measured\n\nChapter 05 made 273.6 tok/s (see the 2026-12-01 file: "
                    "bench/results/2026-12-01-vm.md).\n\n"
                    "Source: [bench/results/2026-12-02-vm.md](../bench/results/2026-12-02-vm.md)\n")
    assert [f.sources for f in figures.figures(page, root)] == [(source,)]
    assert figures.unsourced(page, root) == []
    record = json.loads(source.with_suffix(".json").read_text())
    assert _plant(record, "273.6", 1.5)
    source.with_suffix(".json").write_text(json.dumps(record))
    source.write_text(figures.renderer(record)(record))
    assert figures.unsourced(page, root) == [
        "chapter/README.md:3: '273.6 tok/s': 273.6 is not in bench/results/2026-12-02-vm.md"]


def test_a_quoted_capture_is_checked_against_its_samples_file(tmp_path: Path) -> None:
    """A code block after a line naming a capture of the samples file that
    the section's `Source:` line names must be in that capture."""
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    (results / "2026-01-01-vm-samples.md").write_text(
        "# Samples\n\n## ch03-log\n\n```\nRunning: 1 reqs, Waiting: 0 reqs\n```\n\n"
        "## ch04-log\n\n```\nRunning: 15 reqs, Waiting: 16 reqs\n```\n")
    page = tmp_path / "slides.md"
    page.write_text("one\n\nThe log (\"ch03-log\"):\n\n```\nRunning: 1 reqs, ...\n"
                    "Running: 15 reqs\n```\n\nSource: bench/results/2026-01-01-vm-samples.md\n")
    assert figures.misquoted(page, tmp_path) == [
        "slides.md:7: not in bench/results/2026-01-01-vm-samples.md (ch03-log): "
        "'Running: 15 reqs'"]
