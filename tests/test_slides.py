"""Lint every chapter's `slides.md` so it renders in `mdp` on an 80x24 terminal.

mdp refuses to start when a slide is taller than the terminal, and lines
wider than it are cut. The rules (DESIGN.md, "Slides"):

- the file starts with `%title:`, `%author:` and `%date:` header lines;
- slides are separated by a line `---` that follows an empty line (a `---`
  right after text is a heading underline in mdp, not a slide break; like
  mdp, the lint also splits at other rules such as `***` or `-----`);
- each slide holds at most 20 lines (leading and trailing blank lines not
  counted) of at most 76 columns, and is not empty;
- code fences (``` or ~~~) open and close within one slide;
- no line ends with a backslash: mdp escapes the line break and garbles
  the next line (shell continuations included);
- no inline code in a `# heading` (mdp shows the backticks there);
- inline `code spans` start the line or follow a space (after "(" mdp
  shows the backticks literally), and hold no `*` (mdp reads it as the
  start of red text even there; put such code in a fenced block).

And one component per chapter (the issue's page rules): no slide appears,
whitespace aside, in two decks; no deck holds more than 30 slides, no
chapter README more than 450 lines, the repository's README more than 200.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.slides

ROOT = Path(__file__).resolve().parents[1]
DECKS = sorted(ROOT.glob("*/slides.md"))

HEADERS = ("%title:", "%author:", "%date:")
MAX_LINES = 20
MAX_COLUMNS = 76
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^(-> *)?#")
RULE = re.compile(r"^ *([-*])( *\1){2,} *$")  # what mdp takes for a slide break


@dataclass
class Slide:
    number: int  # 1-based
    lines: list[tuple[int, str]] = field(default_factory=list)  # (file line no, text)
    code: set[int] = field(default_factory=set)  # line numbers inside or on a fence
    open_fence: tuple[int, str] | None = None  # (line no, marker) if left open

    def content(self) -> list[tuple[int, str]]:
        """The slide's lines without leading and trailing blank lines."""
        lines = list(self.lines)
        while lines and not lines[0][1].strip():
            lines.pop(0)
        while lines and not lines[-1][1].strip():
            lines.pop()
        return lines


@dataclass
class Deck:
    path: Path
    header: list[tuple[int, str]]
    slides: list[Slide]
    problems: list[str]  # found while splitting (misplaced separators)


def _name(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def parse_deck(path: Path) -> Deck:
    """Split a deck the way mdp does: a rule after an empty line, outside fences."""
    text = path.read_text(encoding="utf-8").expandtabs(4)  # mdp expands tabs to 4
    all_lines = text.split("\n")
    if all_lines and all_lines[-1] == "":
        all_lines.pop()  # the final newline does not make a line
    header: list[tuple[int, str]] = []
    i = 0
    while i < len(all_lines) and all_lines[i].startswith("%"):
        header.append((i + 1, all_lines[i]))
        i += 1

    problems: list[str] = []
    slides = [Slide(number=1)]
    fence: tuple[int, str] | None = None  # the open fence: (line no, marker)
    previous = ""  # the line before, "" at the start of the body
    for index in range(i, len(all_lines)):
        lineno, line = index + 1, all_lines[index]
        slide = slides[-1]
        match = FENCE.match(line)
        if fence is None and RULE.match(line):
            if not previous.strip():
                slides.append(Slide(number=len(slides) + 1))
                previous = line
                continue
            if set(line.strip()) == {"-"}:
                problems.append(
                    f"{_name(path)}:{lineno}: slide {slide.number}: `---` right "
                    "after a text line is a heading underline in mdp, not a slide "
                    "break; put an empty line before it")
        if fence is not None or match:
            slide.code.add(lineno)
        if match:
            marker = match.group(1)
            if fence is None:
                fence = (lineno, marker)
                slide.open_fence = fence
            elif marker[0] == fence[1][0] and len(marker) >= len(fence[1]) \
                    and not line.strip()[len(marker):].strip():
                fence = None
                slide.open_fence = None
        slide.lines.append((lineno, line))
        previous = line
    return Deck(path=path, header=header, slides=slides, problems=problems)


def check_header(deck: Deck) -> list[str]:
    name = _name(deck.path)
    if not deck.header:
        return [f"{name}:1: the deck must start with {', '.join(HEADERS)} lines"]
    errors = []
    found = {line.split(":", 1)[0] + ":": (n, line) for n, line in deck.header}
    for tag in HEADERS:
        if tag not in found:
            errors.append(f"{name}: header line `{tag}` missing at the top")
        elif not found[tag][1][len(tag):].strip():
            errors.append(f"{name}:{found[tag][0]}: `{tag}` has no value")
    first = deck.header[0][1]
    if not first.startswith(HEADERS[0]):
        errors.append(f"{name}:1: the first line should be `%title: ...`, got {first!r}")
    return errors


def check_slide(path: Path, slide: Slide) -> list[str]:
    name, where = _name(path), f"slide {slide.number}"
    content = slide.content()
    if not content:
        first = slide.lines[0][0] if slide.lines else "?"
        return [f"{name}:{first}: {where} is empty (two separators in a row, "
                "or a separator at the end of the file?)"]
    errors = []
    if len(content) > MAX_LINES:
        errors.append(
            f"{name}:{content[0][0]}: {where} has {len(content)} lines "
            f"(lines {content[0][0]}-{content[-1][0]}), at most {MAX_LINES} fit "
            "an 80x24 terminal")
    for lineno, line in content:
        width = len(line.rstrip())
        if width > MAX_COLUMNS:
            errors.append(f"{name}:{lineno}: {where}: line is {width} columns wide, "
                          f"at most {MAX_COLUMNS}: {line.rstrip()[:40]!r}...")
        trailing = len(line.rstrip()) - len(line.rstrip().rstrip("\\"))
        if trailing % 2:
            errors.append(f"{name}:{lineno}: {where}: a line ending with a backslash "
                          "garbles the next line in mdp; avoid the continuation")
        if lineno in slide.code:
            continue
        if HEADING.match(line) and "`" in line:
            errors.append(f"{name}:{lineno}: {where}: mdp shows backticks in a "
                          f"heading literally: {line.strip()!r}")
        if not line.startswith("    "):  # 4 spaces: an indented code block
            for span in CODE_SPAN.finditer(line):
                before = line[span.start() - 1] if span.start() else " "
                if not before.isspace():
                    errors.append(
                        f"{name}:{lineno}: {where}: inline code {span.group(0)!r} "
                        f"right after {before!r} shows its backticks in mdp; "
                        "put a space before it")
                if "*" in span.group(2):
                    errors.append(
                        f"{name}:{lineno}: {where}: `*` inside the inline code "
                        f"{span.group(0)!r} turns the rest red in mdp; use a "
                        "fenced code block")
    if slide.open_fence is not None:
        lineno, marker = slide.open_fence
        errors.append(f"{name}:{lineno}: {where}: code fence {marker} opened here "
                      "is not closed before the end of the slide")
    return errors


def test_decks_found() -> None:
    assert DECKS, f"no */slides.md found under {ROOT}"


def lint(path: Path) -> list[str]:
    deck = parse_deck(path)
    errors = check_header(deck) + deck.problems
    for slide in deck.slides:
        errors += check_slide(path, slide)
    return errors


@pytest.mark.parametrize("path", DECKS, ids=[_name(p) for p in DECKS])
def test_slides_render_in_mdp(path: Path) -> None:
    errors = lint(path)
    assert not errors, f"{len(errors)} problem(s) in {_name(path)}:\n" + "\n".join(errors)


# -- the lint itself, on small decks ------------------------------------------
GOOD_HEADER = "%title: t\n%author: a\n%date: d\n\n"


@pytest.mark.parametrize("body, expected", [
    ("one\n\n---\n\ntwo\n", []),
    ("```\na\n\n---\n\nb\n```\n", []),  # `---` inside a fence: no break
    ("one\n---\ntwo\n", ["heading underline"]),
    ("one\n\n-----\n\ntwo\n", []),  # any rule after an empty line splits
    ("one\n***\n", []),  # a rule right after text does not split
    ("one\n\n---\n\n---\n\ntwo\n", ["slide 2 is empty"]),
    ("one\n\n---\n", ["slide 2 is empty"]),
    ("\n".join(f"l{i}" for i in range(21)) + "\n", ["slide 1 has 21 lines"]),
    ("x" * 77 + "\n", ["77 columns"]),
    ("```\ncode\n\n---\n\nmore\n", ["not closed"]),
    ("use `a * b` here\n", ["`*` inside"]),
    ("call (`f`) now\n", ["shows its backticks"]),
    ("# the `f` call\n", ["heading"]),
    ("```\ncurl a \\\n  -d b\n```\n", ["backslash"]),
])
def test_lint_catches(tmp_path: Path, body: str, expected: list[str]) -> None:
    deck = tmp_path / "slides.md"
    deck.write_text(GOOD_HEADER + body)
    errors = lint(deck)
    assert len(errors) == len(expected), errors
    for error, fragment in zip(errors, expected):
        assert fragment in error, (fragment, error)


def test_lint_requires_the_header(tmp_path: Path) -> None:
    deck = tmp_path / "slides.md"
    deck.write_text("%title: t\n\nbody\n")
    errors = lint(deck)
    assert any("%author:" in e for e in errors) and any("%date:" in e for e in errors)
    deck.write_text("body\n")
    assert "must start with" in lint(deck)[0]


# -- one component per chapter: no slide twice, no chapter too long ----------
MAX_SLIDES = 30
MAX_ROOT_README_LINES = 200
MAX_CHAPTER_README_LINES = 450


def slide_text(slide: Slide) -> str:
    """A slide as the duplicate check compares it: its text, whitespace removed."""
    return "".join("".join(text for _, text in slide.content()).split())


def repeated_slides(decks: list[Path]) -> list[str]:
    """Slides that appear, whitespace aside, in two decks."""
    seen: dict[str, tuple[Path, Slide]] = {}
    found = []
    for path in decks:
        for slide in parse_deck(path).slides:
            text = slide_text(slide)
            if not text:
                continue
            if text in seen and seen[text][0] != path:
                other, first = seen[text]
                found.append(f"{_name(path)}: slide {slide.number} is slide "
                             f"{first.number} of {_name(other)}")
            seen.setdefault(text, (path, slide))
    return found


def too_long(root: Path = ROOT) -> list[str]:
    """The root README over 200 lines, a chapter README over 450, a deck
    over 30 slides."""
    found = []
    readmes = [(root / "README.md", MAX_ROOT_README_LINES)]
    readmes += [(p, MAX_CHAPTER_README_LINES)
                for p in sorted(root.glob("[0-9][0-9]-*/README.md"))]
    for path, limit in readmes:
        if path.exists() and (n := len(path.read_text().splitlines())) > limit:
            found.append(f"{_name(path)}: {n} lines, at most {limit}")
    for path in sorted(root.glob("[0-9][0-9]-*/slides.md")):
        if (n := len(parse_deck(path).slides)) > MAX_SLIDES:
            found.append(f"{_name(path)}: {n} slides, at most {MAX_SLIDES}")
    return found


def test_no_slide_in_two_decks() -> None:
    found = repeated_slides(DECKS)
    assert not found, "\n".join(found)


def test_readmes_and_decks_within_their_length() -> None:
    found = too_long()
    assert not found, "\n".join(found)


def test_the_length_and_repeat_lints_catch(tmp_path: Path) -> None:
    one, two = tmp_path / "01-a" / "slides.md", tmp_path / "02-b" / "slides.md"
    one.parent.mkdir()
    two.parent.mkdir()
    one.write_text(GOOD_HEADER + "# Same\n\nbody\n\n---\n\nonly here\n")
    two.write_text(GOOD_HEADER + "#  Same\nbody   \n\n---\n\n"
                   + "\n\n---\n\n".join(f"s{i}" for i in range(30)) + "\n")
    (tmp_path / "README.md").write_text("x\n" * 201)
    (tmp_path / "01-a" / "README.md").write_text("x\n" * 450)
    (tmp_path / "02-b" / "README.md").write_text("x\n" * 451)
    assert [f.replace(f"{tmp_path}/", "") for f in repeated_slides([one, two])] == [
        "02-b/slides.md: slide 1 is slide 1 of 01-a/slides.md"]
    assert [f.replace(f"{tmp_path}/", "") for f in too_long(tmp_path)] == [
        "README.md: 201 lines, at most 200",
        "02-b/README.md: 451 lines, at most 450",
        "02-b/slides.md: 31 slides, at most 30"]
