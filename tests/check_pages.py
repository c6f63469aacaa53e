"""The pages lint: prose a learner reads in one sitting, and quotes that match their files.

    python -m tests.check_pages          # each chapter's figures, and what is over (make lint-pages)

**Prose.** In each chapter README, the median sentence is at most
MAX_MEDIAN_WORDS words and the 90th percentile at most MAX_P90_WORDS. How
sentences are counted (`sentence_lengths`):

- prose only: fenced blocks, tables, headings, images and HTML are dropped;
- a full stop, `!` or `?` followed by a space ends a sentence, and so do a
  blank line and the start of a list item ("e.g." and "i.e." do not);
- a `code span` counts as one word, a link as the words of its text.

**Slides.** In each deck, the median slide holds at most
MAX_MEDIAN_SLIDE_LINES lines (tests/test_slides.py splits the decks as mdp
does; the first slide, the title, is not counted).

**Quotes.** Two kinds of quote name their file, and must match it:

- a fenced block right after a caption line that starts with
  "From `PATH`" and ends with ":" is a verbatim quote: its lines, with
  their common indentation removed, are lines of PATH in the same order
  (a line "..." stands for lines left out; trailing spaces do not count);
- "`wc -l PATH`: N lines" (in a code block: "wc -l PATH   # N") says how
  many lines PATH has, and a table whose
  header row is "| lines of `PATH` | ... |" gives line ranges "A-B" of
  PATH: the ranges cover the file from its first line to its last, in
  order, without a gap or an overlap.

tests/test_pages.py runs these on every page, and on planted changes.

Left out: the meaning of a sentence (the lint counts words, a reader
judges the rest), quoted error messages (tests/test_docs.py checks those
where a page quotes one).
"""
from __future__ import annotations

import ast
import re
import statistics
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pictures.make.figures import pages  # noqa: E402
from tests.test_slides import parse_deck  # noqa: E402

MAX_MEDIAN_WORDS = 18
MAX_P90_WORDS = 30
MAX_MEDIAN_SLIDE_LINES = 14

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
NOT_AN_END = re.compile(r"\b(?:e\.g|i\.e|vs|cf|etc)\.$", re.IGNORECASE)
SENTENCE_END = re.compile(r"[.!?][)\"'”’*_]*$")


# ------------------------------------------------------------------ prose
def prose_lines(text: str) -> list[str]:
    """The page's prose: fenced blocks, tables, headings, images and HTML
    dropped (an empty line kept in their place: a paragraph ends there)."""
    kept, fence = [], None
    for line in text.split("\n"):
        opening = FENCE.match(line)
        if fence is not None:
            if opening and opening.group(1)[0] == fence:
                fence = None
            kept.append("")
            continue
        if opening:
            fence = opening.group(1)[0]
            kept.append("")
            continue
        stripped = line.strip()
        if stripped.startswith(("|", "#", "<", "![")) or stripped in ("---", "***"):
            kept.append("")
            continue
        kept.append(line)
    return kept


def words_of(line: str) -> list[str]:
    """A line's words: a code span is one word, a link the words of its text."""
    line = LINK.sub(lambda m: f" {m.group(1)} ", line)
    line = CODE_SPAN.sub("CODE", line)
    return [word for word in line.split() if any(c.isalnum() for c in word)]


def sentence_lengths(text: str) -> list[int]:
    """The number of words of each sentence of the page's prose."""
    lengths: list[int] = []
    current = 0

    def end() -> None:
        nonlocal current
        if current:
            lengths.append(current)
        current = 0

    for line in prose_lines(text):
        if not line.strip():
            end()
            continue
        if LIST_ITEM.match(line):
            end()
            line = LIST_ITEM.sub("", line, count=1)
        for word in words_of(line):
            current += 1
            if SENTENCE_END.search(word) and not NOT_AN_END.search(word):
                end()
    end()
    return lengths


def percentile(values: list[int], fraction: float) -> float:
    """The value below which `fraction` of them lie (nearest rank)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(fraction * len(ordered)) - 1))]


@dataclass
class ProseFigures:
    sentences: int
    median_words: float
    p90_words: float

    def over(self) -> list[str]:
        problems = []
        if self.median_words > MAX_MEDIAN_WORDS:
            problems.append(f"median sentence {self.median_words:g} words > {MAX_MEDIAN_WORDS}")
        if self.p90_words > MAX_P90_WORDS:
            problems.append(f"90th percentile {self.p90_words:g} words > {MAX_P90_WORDS}")
        return problems


def prose_figures(path: Path) -> ProseFigures:
    lengths = sentence_lengths(path.read_text(encoding="utf-8"))
    return ProseFigures(len(lengths), statistics.median(lengths), percentile(lengths, 0.9))


def deck_median_lines(path: Path) -> float:
    """The median slide's height, the title slide left out."""
    slides = parse_deck(path).slides[1:]
    return statistics.median(len(slide.content()) for slide in slides)


# ----------------------------------------------------------------- quotes
QUOTE_CAPTION = re.compile(r"^From `([^`]+)`.*:\s*$")
LINE_COUNT = re.compile(r"`wc -l ([^`]+)`: (\d+) lines")
LINE_COUNT_IN_CODE = re.compile(r"wc -l (\S+)\s+# *(\d+)\b")
RANGE_HEADER = re.compile(r"^\|\s*lines of `([^`]+)`\s*\|")
RANGE = re.compile(r"^\|\s*(\d+)-(\d+)\s*\|")


def file_lines(path: str) -> list[str] | None:
    file = ROOT / path
    return file.read_text(encoding="utf-8").split("\n")[:-1] if file.is_file() else None


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip())


def verbatim_problem(path: str, block: list[str]) -> str | None:
    """Why a block quoted from `path` is not its lines, in order, with their
    indentation shifted alike (None: it is)."""
    lines = file_lines(path)
    if lines is None:
        return f"`{path}` does not exist"
    at, shift = 0, None
    for want in block:
        if not want.strip() or want.strip() == "...":
            continue
        for i in range(at, len(lines)):
            have = lines[i]
            if have.strip() == want.strip() and shift in (None, indent_of(have) - indent_of(want)):
                at, shift = i + 1, indent_of(have) - indent_of(want)
                break
        else:
            return f"quotes a line that is not in `{path}` (or not in this order): {want.strip()!r}"
    return None


def count_problems(counts: list[tuple[str, str]], number: int) -> list[str]:
    """Each (path, count) quoted at line `number` that is not the file's."""
    problems = []
    for path, count in counts:
        have = file_lines(path)
        if have is None or len(have) != int(count):
            problems.append(f"line {number}: `{path}` has "
                            f"{'no file' if have is None else len(have)} lines, "
                            f"the page says {count}")
    return problems


def quote_problems(text: str) -> list[str]:
    """Each quote of the page that does not match its file, with its line."""
    problems = []
    lines = text.split("\n")
    caption_path, block, fence, start = None, [], None, 0
    table_path, next_line, table_line = None, 1, 0
    for number, line in enumerate(lines, 1):
        opening = FENCE.match(line)
        if fence is not None:
            if opening and opening.group(1)[0] == fence:
                if caption_path:
                    problem = verbatim_problem(caption_path, block)
                    if problem:
                        problems.append(f"line {start}: {problem}")
                fence, caption_path = None, None
            else:
                block.append(line)
                problems += count_problems(LINE_COUNT_IN_CODE.findall(line), number)
            continue
        if opening:
            fence, block, start = opening.group(1)[0], [], number
            previous = [l for l in lines[max(0, number - 3):number - 1] if l.strip()]
            match = QUOTE_CAPTION.match(previous[-1]) if previous else None
            caption_path = match.group(1) if match else None
            continue
        problems += count_problems(LINE_COUNT.findall(line), number)
        header = RANGE_HEADER.match(line)
        if header:
            table_path, next_line, table_line = header.group(1), 1, number
            continue
        if table_path:
            if line.startswith("|---") or line.startswith("| ---"):
                continue
            row = RANGE.match(line)
            if row:
                first, last = int(row.group(1)), int(row.group(2))
                if first != next_line or last < first:
                    problems.append(f"line {number}: lines {first}-{last} of `{table_path}`: "
                                    f"the row above ends at {next_line - 1}")
                next_line = last + 1
                continue
            problems += ranges_end_problems(table_path, next_line - 1, table_line)
            table_path = None
    if table_path:  # a table at the end of the page
        problems += ranges_end_problems(table_path, next_line - 1, table_line)
    return problems


def ranges_end_problems(path: str, last: int, number: int) -> list[str]:
    """A range table (its header at line `number`) must end at the file's last line."""
    have = file_lines(path)
    if have is not None and last == len(have):
        return []
    return [f"line {number}: the ranges of `{path}` end at {last}, the file has "
            f"{'no' if have is None else len(have)} lines"]


# --------------------------------------------------------- error messages
ERROR_MESSAGE = re.compile(r'"error"\s*:\s*\{\s*"message"\s*:\s*"((?:[^"\\\n]|\\.)*)("?)')
CODE_FOLDERS = ("common", "bench", *(p.name for p in sorted(ROOT.glob("[0-9][0-9]-*"))))


@lru_cache(maxsize=None)
def course_code() -> tuple[tuple[re.Pattern, ...], str]:
    """Every string the course's code writes with at least 12 characters of
    its own, as a pattern (an f-string's fields match any text), and all
    the code's text."""
    patterns, texts = set(), []
    for folder in CODE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            texts.append(text)
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.JoinedStr):
                    literal = [v.value for v in node.values if isinstance(v, ast.Constant)]
                    if len("".join(map(str, literal))) >= 12:
                        patterns.add("".join(re.escape(str(v.value)) if isinstance(v, ast.Constant)
                                             else ".+?" for v in node.values))
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                        and len(node.value) >= 12:
                    patterns.add(re.escape(node.value))
    return tuple(re.compile(p, re.DOTALL) for p in patterns), "\n".join(texts)


EXCEPTION_PREFIX = re.compile(r"^\w+(?:Error|Exception): ")


def message_matches_code(message: str, whole: bool = True) -> bool:
    """A quoted error message is a string of the code (its fields filled in,
    a full stop after it allowed, an exception's name before it). A quote
    cut short (with "...", or running on to the next line: not `whole`) is
    checked by its words: each piece between its figures and code spans is
    in the code."""
    message = EXCEPTION_PREFIX.sub("", message)
    cut = re.split(r"\s*(?:\.\.\.|…)", message, maxsplit=1)[0]
    templates, code = course_code()
    if cut != message or not whole:
        pieces = re.split(r"\d[\d.,]*|`[^`]*`|: ", cut)
        return all(piece.strip() in code for piece in pieces if len(piece.strip()) >= 4)
    return any(t.fullmatch(message) or t.fullmatch(message.removesuffix("."))
               for t in templates)


def message_problems(text: str) -> list[str]:
    """Each error envelope's message on the page that the code cannot write."""
    problems = []
    for number, line in enumerate(text.split("\n"), 1):
        for raw, closed in ERROR_MESSAGE.findall(line):
            message = raw.replace('\\"', '"')
            if not message_matches_code(message, whole=bool(closed)):
                problems.append(f"line {number}: an error message the code does not write: "
                                f"{message[:80]!r}")
    return problems


# ------------------------------------------------------------------ report
def chapter_readmes() -> list[Path]:
    return sorted(ROOT.glob("[0-9][0-9]-*/README.md"))


def decks() -> list[Path]:
    return sorted(ROOT.glob("[0-9][0-9]-*/slides.md"))


def main() -> int:
    failed = False
    print(f"{'chapter README':<44} sentences  median  p90   (at most {MAX_MEDIAN_WORDS} and "
          f"{MAX_P90_WORDS} words)")
    for path in chapter_readmes():
        figures = prose_figures(path)
        over = figures.over()
        failed |= bool(over)
        print(f"{str(path.relative_to(ROOT)):<44} {figures.sentences:>9}  "
              f"{figures.median_words:>6g}  {figures.p90_words:>3g}   {'; '.join(over)}")
    print(f"\n{'deck':<44} median lines a slide (at most {MAX_MEDIAN_SLIDE_LINES})")
    for path in decks():
        median = deck_median_lines(path)
        failed |= median > MAX_MEDIAN_SLIDE_LINES
        print(f"{str(path.relative_to(ROOT)):<44} {median:>6g}"
              f"{'   over' if median > MAX_MEDIAN_SLIDE_LINES else ''}")
    print()
    for page in pages():
        text = page.read_text(encoding="utf-8")
        for problem in quote_problems(text) + message_problems(text):
            failed = True
            print(f"{page.relative_to(ROOT)}: {problem}")
    print("pages lint:", "over" if failed else "passes")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
