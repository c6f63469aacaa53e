"""The pages lint (tests/check_pages.py, `make lint-pages`): every chapter
README reads in one sitting, every deck's slides are short, and every
quote that names its file matches it. The lint itself is tested on
planted pages: a sentence counted as the issue defines it, and a quoted
file changed under its quote."""
from __future__ import annotations

from pathlib import Path

import pytest

from pictures.make.figures import pages
from tests import check_pages
from tests.check_pages import (MAX_MEDIAN_SLIDE_LINES, chapter_readmes, deck_median_lines, decks,
                               message_problems, prose_figures, quote_problems, sentence_lengths)

ROOT = Path(__file__).resolve().parents[1]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ------------------------------------------------------------ the counter
def test_sentences_are_counted_as_the_issue_defines_them():
    text = "\n".join([
        "# A heading is not prose at all",
        "One two three. Four five!",
        "Six `a code span with spaces` seven, e.g. eight nine?",
        "",
        "A paragraph that",
        "runs over two lines",
        "",
        "- a list item",
        "- [a link](https://example.com) here",
        "| a | table | row |",
        "![an image](x.png)",
        "```",
        "code is not prose. at all.",
        "```",
        "<!-- html -->"])
    assert sentence_lengths(text) == [3, 2, 6, 7, 3, 3]


# ---------------------------------------------------------- the quotes
@pytest.fixture
def quoted_file(tmp_path, monkeypatch):
    """A file the planted pages quote, under a root of its own."""
    monkeypatch.setattr(check_pages, "ROOT", tmp_path)
    (tmp_path / "pkg").mkdir()
    path = tmp_path / "pkg" / "mod.py"
    path.write_text("def f(x):\n    y = x + 1\n    return y\n\n\ndef g():\n    return 2\n")
    return path


VERBATIM = "From `pkg/mod.py`, `f`:\n\n```python\ndef f(x):\n    ...\n    return y\n```\n"
COUNTS = "`wc -l pkg/mod.py`: 7 lines.\n\n```\n$ wc -l pkg/mod.py   # 7\n```\n"
RANGES = ("| lines of `pkg/mod.py` | what |\n|---|---|\n| 1-3 | f |\n| 4-5 | blank |\n"
          "| 6-7 | g |\n\nAfter the table.\n")


def test_quotes_that_match_their_file_pass(quoted_file):
    assert quote_problems(VERBATIM + COUNTS + RANGES) == []


def test_the_lint_catches_a_planted_change_in_a_quoted_file(quoted_file):
    quoted_file.write_text(quoted_file.read_text().replace("return y", "return y * 2"))
    assert quote_problems(VERBATIM) == [
        "line 3: quotes a line that is not in `pkg/mod.py` (or not in this order): 'return y'"]
    quoted_file.write_text(quoted_file.read_text() + "\n\ndef h():\n    pass\n")
    found = quote_problems(COUNTS + RANGES)
    assert found == [
        "line 1: `pkg/mod.py` has 11 lines, the page says 7",
        "line 4: `pkg/mod.py` has 11 lines, the page says 7",
        "line 6: the ranges of `pkg/mod.py` end at 7, the file has 11 lines"]


def test_the_lint_catches_lines_out_of_order_or_reindented(quoted_file):
    swapped = "From `pkg/mod.py`:\n```\n    return y\n    y = x + 1\n```\n"
    assert "not in this order" in quote_problems(swapped)[0]
    reindented = "From `pkg/mod.py`:\n```\ndef f(x):\ny = x + 1\n```\n"
    assert "'y = x + 1'" in quote_problems(reindented)[0]
    gap = RANGES.replace("| 4-5 | blank |\n", "")
    assert quote_problems(gap) == [
        "line 4: lines 6-7 of `pkg/mod.py`: the row above ends at 3"]


def test_the_lint_catches_an_error_message_the_code_does_not_write():
    real = '{"error":{"message":"The model `gpt-4` does not exist.","type":"not_found_error"}}'
    cut = '{"error": {"message": "OutOfMemoryError: CUDA out of memory ...",'
    running_on = '{"error":{"message":"This model\'s maximum context length is 8192'
    assert message_problems("\n".join([real, cut, running_on])) == []
    for wrong in (real.replace("does not exist", "is not served"),
                  cut.replace("out of memory", "out of blocks"),
                  running_on.replace("context length", "prompt length")):
        assert len(message_problems(wrong)) == 1, wrong


@pytest.mark.parametrize("page", pages(), ids=[_name(p) for p in pages()])
def test_every_quote_on_the_pages_matches_its_file(page):
    text = page.read_text(encoding="utf-8")
    assert quote_problems(text) + message_problems(text) == []


# ---------------------------------------------------------- the limits
@pytest.mark.parametrize("readme", chapter_readmes(), ids=[_name(p) for p in chapter_readmes()])
def test_each_chapter_readme_reads_in_one_sitting(readme):
    assert prose_figures(readme).over() == []


@pytest.mark.parametrize("deck", decks(), ids=[_name(p) for p in decks()])
def test_each_decks_slides_are_one_idea_each(deck):
    assert deck_median_lines(deck) <= MAX_MEDIAN_SLIDE_LINES
