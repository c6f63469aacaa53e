"""Every figure from its results file: the check behind `make figures` and
tests/test_figures.py.

    python -m pictures.make.figures          # write every results .md from its .json, then check the pages
    python -m pictures.make.figures --check  # change nothing: list what is stale (exit 1 if anything is)

Three checks tie a measurement to the sentence that quotes it:

1. **results file**: `bench/results/X.md` is what the script named in
   `X.json`'s `command` renders from that JSON (`RENDERERS`; a file
   written before its script moved names the script's earlier home). A number
   changed in either file breaks the equality.
2. **page**: a measured figure on a page (a README, a slide, an exercise) is
   a number with a unit that only a run produces: tok/s, req/s, a ratio
   (`1.57x`), ms, seconds and percentages with decimals (`7.3 s`, `10.2 %`).
   Each must appear in a results file that the same section names on its
   `Source:` line (a section runs from one heading to the next; on
   slides, one slide; a section without a `Source:` line, as on the
   exercises' solutions, names its files anywhere in it). Every
   number of the results file counts, rounded to the figure's decimals
   (a page may say `245 tok/s` where the file says 245.3); a ratio or a
   percentage may be the quotient of two numbers that the same paragraph
   quotes from the file (`11.7x` beside 262.2 and 22.4). A figure that no
   run produced (arithmetic, a rough cost) is listed in `NOT_MEASURED`
   with the reason. A table laid out by hand counts too: the numbers of a
   row whose label carries the unit ("output tokens/s   11.8   273.6").
3. **generated table**: a comparison table between the markers
   `<!-- table from bench/results/X.json ... -->` and `<!-- /table -->` is
   written by `make figures` from the JSON's rows (`with_tables`); a page
   whose table differs from what the file gives fails.

A quoted sample output (a log, `/stats`, an answer) right after a
paragraph that names one of the captures (`"ch03-log-2x64"`, a `## `
heading) of a `*-samples.md` file its section's `Source:` line names, or
that names such a file, must be in that capture line for line
(`misquoted`; pictures/make/samples.py captures them).

Teaching sentences carry no dates and no results paths: on the READMEs
and the slides, a results path or a date (2026-12-02) appears only on a
section's one `Source:` line, its last (`stray_sources`).

Left out: figures in other units (MiB, blocks) are arithmetic the course
shows its working for, checked by the tests of common/memory.py; a figure
may match a different number of its file that happens to be equal.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"

# What a results file's `command` runs (a module, or a module and its
# subcommand) -> the function that writes its .md.
RENDERERS = {
    "bench.bench": "bench.table.render_markdown",
    "common.bench": "bench.table.render_markdown",  # bench/bench.py's earlier home (2026-11-30)
    "bench.experiments.fairness": "bench.experiments.fairness.render",
    "bench.profiles.gemm_bandwidth": "bench.profiles.gemm_bandwidth.markdown",
    "bench.experiments.levers": "bench.experiments.levers.markdown",
    "bench.profiles.profile_step": "bench.profiles.profile_step.markdown",
    "bench.profiles.live_view_cost": "bench.profiles.live_view_cost.markdown",
    "bench.profiles.prefill_attention": "bench.profiles.prefill_attention.markdown",
    "bench.profiles.decode_attention": "bench.profiles.decode_attention.markdown",
    "bench.profiles.cascade_attention": "bench.profiles.cascade_attention.markdown",
    "bench.profiles.serve_profile": "bench.profiles.serve_profile.markdown",
    "bench.experiments.ch06_flags": "bench.experiments.ch06_flags.markdown",
    "bench.experiments.spec_decode": "bench.experiments.spec_decode.markdown",
    "bench.experiments.structured_outputs": "bench.experiments.structured_outputs.markdown",
    "bench.experiments.tensor_parallel": "bench.experiments.tensor_parallel.markdown",
    "bench.peers.vllm_checks diff": "bench.peers.vllm_checks.diff_markdown",
    "bench.peers.vllm_diff": "bench.peers.vllm_checks.diff_markdown",  # its earlier home
    "bench.peers.vllm_checks steps": "bench.peers.vllm_checks.steps_markdown",
    "bench.peers.vllm_steps": "bench.peers.vllm_checks.steps_markdown",  # its earlier home
    "pictures.make.samples": "pictures.make.samples.markdown",
    "bench.pages.samples": "pictures.make.samples.markdown",  # its earlier home
    "bench.gpu.gpu_check": "bench.gpu.gpu_check.render",
    "bench.scale": "bench.scale.markdown",
    "bench.faults": "bench.faults.markdown",
    "bench.vs_vllm": "bench.vs_vllm.markdown",
    "bench.adapters": "bench.adapters.markdown",
}
# A results file's command: the module it runs, and its subcommand if it has one.
COMMAND = re.compile(r"python -m ([\w.]+)(?: ([a-z]+)\b)?")


def pages() -> list[Path]:
    """The pages a learner reads."""
    chapters = "[0-9][0-9]-*"  # 01-concepts ... 10-adapters
    return sorted([ROOT / "README.md", *ROOT.glob("GLOSSARY.md"), ROOT / "bench" / "README.md",
                   *ROOT.glob(f"{chapters}/README.md"), *ROOT.glob(f"{chapters}/appendix.md"),
                   *ROOT.glob(f"{chapters}/slides.md"),
                   *ROOT.glob(f"{chapters}/exercises/*.md")])


# ------------------------------------------------------------ results files
def renderer(record: dict):
    """The function that renders this record's markdown, or None (a file no
    script renders, such as a load test's --json summary)."""
    command = record.get("command", "") if isinstance(record, dict) else ""
    match = COMMAND.match(command)
    if not match:
        return None
    module, subcommand = match.groups()
    path = RENDERERS.get(f"{module} {subcommand}") or RENDERERS.get(module)
    if path is None:
        return None
    home, _, function = path.rpartition(".")
    return getattr(importlib.import_module(home), function)


def rendered(json_path: Path) -> str | None:
    """What the results file's markdown should say, from its JSON."""
    record = json.loads(json_path.read_text())
    render = renderer(record)
    return None if render is None else render(record)


def renderable(results: Path = RESULTS):
    """(markdown path, what it should say) for each results file a script renders."""
    for json_path in sorted(results.glob("*.json")):
        text = rendered(json_path)
        if text is not None:
            yield json_path.with_suffix(".md"), text


def stale_results(results: Path = RESULTS) -> list[str]:
    """Results files whose .md is not what their .json renders to."""
    stale = []
    for md, text in renderable(results):
        if not md.exists():
            stale.append(f"{md.name}: missing (its .json renders one)")
        elif md.read_text() != text:
            stale.append(f"{md.name}: not what its .json renders (make figures writes it again)")
    return stale


# ------------------------------------------------------------------- pages
NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
# Numbers that only a run produces: "245.3 tok/s", "3.7 / 7.3 s", "0.91x", "122 ms".
FIGURE = re.compile(
    rf"(?<![\w.,/-])((?:(?:{NUMBER})\s?/\s?)*(?:{NUMBER}))"
    r"(?:\s?(tok/s|tokens/s|output tok/s|req/s|ms)\b"
    r"|(x)(?![\w-])"
    r"|\s?(s|%)(?![\w/]))")
# bench/results/X.md (a bench run), NN-chapter/exercises/results/X.txt (an
# exercise's run), or results/X.json on an exercise's own pages.
RESULTS_FILE = re.compile(r"(?<![\w/-])((?:[\w.-]+/)*results/[\w.-]+\.(?:md|json|txt))\b")
HEADING = re.compile(r"^#{1,6} ")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
# The line that ends a section quoting measured figures: the results files they come from.
SOURCE = re.compile(r"^\s*Source:\s")
DATE = re.compile(r"(?<![\d-])20\d\d-[01]\d-[0-3]\d(?![\d])")
COMMENT = re.compile(r"<!--.*?-->")  # a generated table's markers name their file

# Figures with a unit of measure that no run produced, by page: a piece of
# the figure's line (enough to be unique) -> why it needs no results file.
NOT_MEASURED: dict[str, dict[str, str]] = {
    "09-scale-out/README.md": {
        "at most every 100 ms": "a setting: SNAPSHOT_INTERVAL_S in common/engine/core.py",
        "every 100 ms and when it goes idle": "the same setting",
    },
    "09-scale-out/appendix.md": {
        "73.5 tok/s": "arithmetic, said so: half of the prefix-aware pair's 146.9 tok/s",
    },
    "09-scale-out/slides.md": {
        "73.5.": "arithmetic, said so: half of the prefix-aware pair's 146.9 tok/s",
        "figures every 100 ms": "a setting: SNAPSHOT_INTERVAL_S in common/engine/core.py",
    },
    "01-concepts/exercises/README.md": {
        "2x, 2.6x, 4x?": "the choices of a prediction question (4384 / 1680 token-forwards)",
    },
    "01-concepts/exercises/solutions.md": {
        "gets 99.3 % of the mass": "a softmax of 5, 15 and 10, computed on the page",
        "from 2.61x down towards 2x": "arithmetic: 4384 / 1680 token-forwards",
        "than the 2.61x of the token-forwards": "arithmetic: 4384 / 1680 token-forwards",
        "small at these lengths (0.3 ms": "arithmetic on the table: (260 - 239) ms / 63 tokens",
        "larger (about 3.3 ms per token)": "arithmetic on the one-thread table, per token",
        "measured 7.8 ms with two threads": "a dated past run (2026-12-01), said so on the page",
        "against 0.16 ms with one": "the same dated past run",
    },
    "02-minimal-pytorch-inference/exercises/solutions.md": {
        "used 3.47% of the 2048": "the server log's arithmetic: (39 + 32) / 2048",
        "used 3.22% of the 2048": "the server log's arithmetic: (34 + 32) / 2048",
    },
    "03-kv-cache/exercises/solutions.md": {
        "103 / 8192 = 1.26 % used": "the prediction's arithmetic",
    },
    "05-continuous-batching/exercises/solutions.md": {
        "not 12x slower": "arithmetic: 24 / 2 prefill steps",
    },
    "06-openai-server/exercises/README.md": {
        "summing 1.25 s": "the grading test's fixed inputs",
    },
    "06-openai-server/exercises/solutions.md": {
        "(0.5 + 0.75 = 1.25 s)": "the grading test's fixed inputs, summed",
        "(0.125 + 0.25 + 0.25 = 0.625 s)": "the grading test's fixed inputs, summed",
        "= 3.5 s, queue 0.5 + 0.25 = 0.75 s": "the grading test's fixed inputs, summed",
    },
    "07-structured-and-speculative/exercises/solutions.md": {
        "adds about 2.4 ms, half the 32-row time": "a rough cost: half the 32-row time",
    },
    "README.md": {
        "It claims up to 24x the naive way's": "the source article's claim, quoted as such",
    },
    "GLOSSARY.md": {
        "the cache is 3x smaller": "arithmetic: 9 query heads / 3 KV heads",
    },
    "04-paged-attention/slides.md": {
        "98.8% waste": "arithmetic on the slide: 8,093 of 8,192 slots",
        "99 of 537 blocks (18.4 %": "arithmetic on the slide: 72,990,720 / 737,280 B = 99 blocks",
    },
    "01-concepts/slides.md": {
        "30x less work here": "arithmetic on the slide: 2,260 / 76 token-forwards",
        "cache is 3x smaller": "arithmetic: 9 query heads / 3 KV heads",
    },
    "02-minimal-pytorch-inference/README.md": {
        "~2000 tok/s (Mistral 7B)": "the source article's estimate, quoted as such",
        "~100 tok/s for GPT-2 against ~2000": "the source article's estimates, quoted as such",
        "74 of 8192 slots used: 99.1%": "arithmetic on the page: 1 - 74 / 8192",
        "99.1 % of the reserved slots never used": "arithmetic: 1 - 74 / 8192 (the log line)",
        "(at most every 0.25 s)": "a setting of ClientGone, not a measurement",
    },
    "02-minimal-pytorch-inference/slides.md": {
        "~100 vs ~2000 tok/s (the article)": "the source article's estimates, quoted as such",
        "~100 tok/s (GPT-2, naive)": "the source article's estimates, quoted as such",
        "99.1% of 360 MiB wasted": "arithmetic on the slide: 1 - 74 / 8192",
        "KV waste     99.1% (74 of 8192)": "arithmetic: 1 - 74 / 8192 (the log line)",
        "72x its whole": "arithmetic on the slide: 73,983 / 1,024 tokens",
    },
    "03-kv-cache/slides.md": {
        "*20.4% - 38.2%*": "the PagedAttention paper's Figure 2, quoted with its source",
    },
    "06-openai-server/README.md": {
        "polls every 0.25 s": "the poll interval of cancel_on_disconnect, a setting",
    },
    "06-openai-server/slides.md": {
        "3 requests 0.5 s apart": "the demo's own spacing, a setting",
        "polls every 0.25 s": "the poll interval of cancel_on_disconnect, a setting",
        "0.6 s    vllm:num_requests_running": "a dated past run of the cancellation check",
        "count 5     sum": "the /metrics sums of a dated past run (2026-12-01)",
        "count 122   sum 14.76 s": "the /metrics sums of a dated past run (2026-12-01)",
    },
}


@dataclass(frozen=True)
class Figure:
    line: int
    text: str                  # as the page writes it: "3.7 / 7.3 s"
    numbers: tuple[str, ...]   # ("3.7", "7.3")
    unit: str                  # "tok/s", "x", "ms", "s", "%", ...
    sources: tuple[Path, ...]  # the results files its section names
    beside: tuple[str, ...]    # every number of its paragraph (a ratio's operands)


@dataclass
class Section:
    lines: list[tuple[int, str]]  # (line number, text)
    code: set[int] = field(default_factory=set)  # the line numbers inside code blocks

    def source_lines(self) -> list[tuple[int, str]]:
        """Its `Source:` lines (one, the last, on a page that follows the rules)."""
        return [(n, line) for n, line in self.lines if n not in self.code and SOURCE.match(line)]

    def sources(self, page: Path, root: Path) -> tuple[Path, ...]:
        """The results files its `Source:` line names; without one, those it names anywhere."""
        text = "\n".join(line for _, line in (self.source_lines() or self.lines))
        return tuple(dict.fromkeys(resolve(name, page, root)
                                   for name in RESULTS_FILE.findall(text)))

    def paragraphs(self) -> dict[int, str]:
        """Line number -> its paragraph (the lines up to the nearest blank ones)."""
        of_line, run = {}, []
        for number, text in [*self.lines, (0, "")]:  # a blank line closes the last one
            if text.strip():
                run.append((number, text))
                continue
            paragraph = "\n".join(line for _, line in run)
            of_line.update({n: paragraph for n, _ in run})
            of_line[number], run = text, []
        return of_line


def sections(path: Path) -> list[Section]:
    """A page cut at its headings (and, on slides, at each slide)."""
    slides = path.name == "slides.md"
    cut = [Section([])]
    in_block = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_block = not in_block
            cut[-1].code.add(number)
        elif in_block:
            cut[-1].code.add(number)
        elif HEADING.match(line) or (slides and line.strip() == "---"):
            cut.append(Section([]))
        cut[-1].lines.append((number, line))
    return cut


def resolve(name: str, page: Path, root: Path = ROOT) -> Path:
    """A results file as a page names it: from the repository's root
    (`bench/results/...`, `05-.../exercises/results/...`), or from the page's
    folder (an exercise page's `results/...`, a link's `../bench/results/...`)."""
    if name.startswith(("results/", "./", "../")):
        return Path(os.path.normpath(page.parent / name))
    return root / name


def _is_figure(match: re.Match, line: str) -> bool:
    numbers = re.findall(NUMBER, match.group(1))
    if match.group(4) in ("s", "%") and not any("." in n for n in numbers):
        return False  # "20 s", "90%": rough or set, not measured to a decimal
    if match.group(3) == "x" and re.search(r"\d\s*x\s*$", line[:match.start()]):
        return False  # the end of a product: "2 x 4x"
    return True


# A row of a table laid out by hand, its unit in its label:
# "output tokens/s    11.8    273.6", "e2e p50 (s)    172.8    7.4".
ROW = re.compile(r"^\s*([A-Za-z][\w /-]*?(tok/s|tokens/s|\(s\)|\(ms\)))\s{2,}(\S.*)$")


def _row_figures(line: str) -> tuple[str, list[str]]:
    """The unit and the numbers of a hand-laid table row, or ("", [])."""
    match = ROW.match(line)
    if not match:
        return "", []
    unit = match.group(2).strip("()")
    numbers = re.findall(NUMBER, match.group(3))
    if unit == "s":
        numbers = [n for n in numbers if "." in n]
    return unit, numbers


def figures(path: Path, root: Path = ROOT) -> list[Figure]:
    found = []
    for section in sections(path):
        sources = section.sources(path, root)
        paragraphs = section.paragraphs()
        for number, line in section.lines:
            beside = tuple(re.findall(NUMBER, paragraphs[number]))
            for match in FIGURE.finditer(line):
                if _is_figure(match, line):
                    unit = next(u for u in match.groups()[1:] if u)
                    found.append(Figure(number, match.group(0).strip(),
                                        tuple(re.findall(NUMBER, match.group(1))), unit,
                                        sources, beside))
            unit, numbers = _row_figures(line)
            found += [Figure(number, n, (n,), unit, sources, beside) for n in numbers]
    return found


def _decimals(number: str) -> int:
    return len(number.split(".")[1]) if "." in number else 0


def _value(number: str) -> float:
    return float(number.replace(",", ""))


# A number a results file holds, with the decimals it is known to: a page
# that says 378.0 needs a number known to one decimal (not the integer 378).
Held = tuple[float, int]
EXACT = 15  # a float in the JSON: as many decimals as a page could want


def leaf_values(value: float, key: str) -> list[Held]:
    """A JSON number as a page may quote it: itself, a key in seconds also
    in ms, a fraction also in %."""
    places = 0 if isinstance(value, int) else EXACT
    if key.endswith("_s") and not key.endswith("_per_s"):
        return [(value, places), (value * 1000, places)]
    if 0 <= value <= 1 and not key.endswith("_per_s"):
        return [(value, places), (value * 100, places)]
    return [(value, places)]


def _numbers_of_text(text: str) -> list[Held]:
    return [(_value(n), _decimals(n)) for n in re.findall(NUMBER, text)]


def numbers_in(path: Path) -> list[Held]:
    """Every number a results file holds; for bench's markdown, its JSON's too
    (a key in seconds also in ms, a fraction also in %)."""
    values: list[Held] = []
    files = [path, path.with_suffix(".json")] if path.suffix == ".md" else [path]
    for file in dict.fromkeys(files):
        if not file.exists():
            continue
        if file.suffix != ".json":
            values += _numbers_of_text(file.read_text())
            continue

        def walk(node, key: str = ""):
            if isinstance(node, bool):
                return
            if isinstance(node, (int, float)):
                values.extend(leaf_values(node, key))
            elif isinstance(node, dict):
                for name, child in node.items():
                    walk(child, name)
            elif isinstance(node, list):
                for child in node:
                    walk(child, key)
            elif isinstance(node, str):
                values.extend(_numbers_of_text(node))
        walk(json.loads(file.read_text()))
    return values


def _held(number: str, values: list[Held]) -> bool:
    """The file holds the number, at the page's precision (from a number
    known to that precision at least)."""
    want, places = _value(number), _decimals(number)
    precise = np.asarray([v for v, known in values if known >= places], dtype=np.float64)
    return bool(np.any(np.abs(np.round(precise, places) - want) < 10 ** -places / 2))


def _quotient(number: str, unit: str, operands: list[str]) -> bool:
    """A ratio (`x`) or a percentage that is the quotient of two numbers the
    same paragraph quotes from the file, to within the page's last digit."""
    if unit not in ("x", "%") or len(operands) < 2:
        return False
    held = np.unique(np.asarray([_value(n) for n in operands], dtype=np.float64))
    held = held[held != 0]
    quotients = held[:, None] / held[None, :] * (100 if unit == "%" else 1)
    places = _decimals(number)
    return bool(np.any(np.abs(np.round(quotients, places) - _value(number)) < 10 ** -places / 2))


def unsourced(path: Path, root: Path = ROOT) -> list[str]:
    """The page's figures that no results file of their section holds."""
    page = str(path.relative_to(root))
    excused = NOT_MEASURED.get(page, {})
    lines = path.read_text().splitlines()
    held: dict[tuple[Path, ...], list[Held]] = {}  # the numbers of a section's files
    problems = []
    for figure in figures(path, root):
        if any(piece in lines[figure.line - 1] for piece in excused):
            continue
        where = f"{page}:{figure.line}: {figure.text!r}"
        named = ", ".join(str(s.relative_to(root)) for s in figure.sources)
        if not figure.sources:
            problems.append(f"{where} names no results file in its section")
        elif not any(s.exists() for s in figure.sources):
            problems.append(f"{where}: {named} does not exist")
        else:
            if figure.sources not in held:
                held[figure.sources] = [v for s in figure.sources for v in numbers_in(s)]
            values = held[figure.sources]
            operands = [n for n in figure.beside if _held(n, values)]
            absent = [n for n in figure.numbers if not _held(n, values)
                      and not _quotient(n, figure.unit, operands)]
            if absent:
                problems.append(f"{where}: {', '.join(absent)} is not in {named}")
    return problems


def _quotes(line: str, text_lines: list[str]) -> bool:
    """Is the quoted line part of one of the file's lines ("..." skips)?"""
    pattern = ".*".join(re.escape(piece.strip()) for piece in line.strip().split("..."))
    return any(re.search(pattern, candidate) for candidate in text_lines)


def captures(path: Path) -> dict[str, list[str]]:
    """A samples file's captures: the name of each `## ` heading -> its lines."""
    found: dict[str, list[str]] = {}
    name = None
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            name = line[3:].strip()
            found[name] = []
        elif name is not None:
            found[name].append(line)
    return found


def _quoted_capture(before: str, named: dict[str, tuple[Path, list[str]]], page: Path,
                    root: Path) -> tuple[str, list[str]] | None:
    """What a code block right after the paragraph `before` quotes, if
    anything: (how to name it, its lines). A capture of the section's samples
    files named there (the last one named), or a samples file named there."""
    found = [(m.start(), name) for name in named
             for m in re.finditer(rf"(?<![\w-]){re.escape(name)}(?![\w-])", before)]
    if found:
        name = max(found)[1]
        file, lines = named[name]
        return f"{file.relative_to(root)} ({name})", lines
    files = [n for n in RESULTS_FILE.findall(before) if "-samples." in n]
    if files:
        source = resolve(files[-1], page, root)
        lines = source.read_text().splitlines() if source.exists() else []
        return str(source.relative_to(root)), lines
    return None


def misquoted(path: Path, root: Path = ROOT) -> list[str]:
    """A code block right after a paragraph that names a capture of a
    samples file (pictures/make/samples.py's) that its section's `Source:` line
    names, or that names a samples file itself, quotes it: each of its lines must be
    part of one of the capture's lines (a slide may wrap a long line; "..."
    leaves a part out). Tables laid out anew are checked figure by figure
    instead."""
    page = str(path.relative_to(root))
    problems = []
    for section in sections(path):
        named = {name: (source, lines)
                 for source in section.sources(path, root)
                 if "-samples." in source.name and source.exists()
                 for name, lines in captures(source).items()}
        paragraph, gap, block, quoted = [], False, None, None  # the prose before a block
        for number, line in section.lines:
            if FENCE.match(line):
                if block is None:
                    before = "\n".join(paragraph)
                    quoted, block = _quoted_capture(before, named, path, root), []
                else:
                    if quoted is not None:
                        label, file_lines = quoted
                        problems += [f"{page}:{n}: not in {label}: {text.strip()!r}"
                                     for n, text in block
                                     if text.strip() and not _quotes(text, file_lines)]
                    block, paragraph, gap = None, [], False
            elif block is not None:
                block.append((number, line))
            elif line.strip():
                paragraph, gap = ([] if gap else paragraph) + [line], False
            else:
                gap = True
    return problems


def taught_pages() -> list[Path]:
    """The pages whose sentences teach: the READMEs and the slides (not the
    exercises' solutions, which show a run's details, nor the glossary)."""
    return [p for p in pages() if p.name == "slides.md" or p.name.startswith("README")]


def stray_sources(path: Path, root: Path = ROOT) -> list[str]:
    """A results path or a date outside a `Source:` line (a generated
    table's `<!-- ... -->` markers aside); a section with two `Source:`
    lines, or one that is not its last line."""
    page = str(path.relative_to(root))
    problems = []
    for section in sections(path):
        source_lines = section.source_lines()
        for number, line in section.lines:
            if (number, line) in source_lines:
                continue
            text = COMMENT.sub("", line)
            problems += [f"{page}:{number}: results path outside the Source: line: {name}"
                         for name in RESULTS_FILE.findall(text)]
            problems += [f"{page}:{number}: date outside the Source: line: {m.group()}"
                         for m in DATE.finditer(text)]
        problems += [f"{page}:{number}: a second Source: line in one section"
                     for number, _ in source_lines[1:]]
        written = [number for number, line in section.lines if line.strip()]
        if source_lines and source_lines[-1][0] != written[-1]:
            problems.append(f"{page}:{source_lines[-1][0]}: the Source: line is not the "
                            "last line of its section")
    return problems


# ---------------------------------------------------- generated tables
# A table a page does not write by hand: `make figures` writes it between
#   <!-- table from bench/results/X.json: rows 02; 05; vLLM 0.32.0 float32 -->
#   <!-- /table -->
# from the results file's rows (all of them that ran, without "rows ..."),
# with the columns that matter for a chapter-by-chapter comparison.
TABLE = re.compile(r"(<!-- table from (bench/results/[\w.-]+\.json)(?:: rows ([^>]*?))? -->\n)"
                   r"(.*?)(<!-- /table -->)", re.S)
TABLE_COLUMNS = ["system", "card", "load", "done / failed", "output tok/s", "x ch02", "x vLLM",
                 "e2e p50 / p95 s", "KV waste"]


def comparison_table(record: dict, names: list[str] | None) -> str:
    from bench.table import markdown_table
    rows = [r for r in record["rows"] if r["status"] not in ("skipped", "error")]
    if names is not None:
        by_name = {r["name"]: r for r in rows}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise KeyError(f"no row {', '.join(missing)} in the results file")
        rows = [by_name[n] for n in names]
    return markdown_table(rows, TABLE_COLUMNS) + "\n"


def with_tables(text: str, root: Path = ROOT) -> str:
    """The page's text with every generated table written anew."""
    def write(match: re.Match) -> str:
        record = json.loads((root / match.group(2)).read_text())
        names = [n.strip() for n in match.group(3).split(";")] if match.group(3) else None
        return match.group(1) + comparison_table(record, names) + match.group(5)
    return TABLE.sub(write, text)


def stale_tables(path: Path, root: Path = ROOT) -> list[str]:
    text = path.read_text()
    if with_tables(text, root) == text:
        return []
    return [f"{path.relative_to(root)}: a generated table is not what its results file "
            "gives (make figures writes it again)"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    args = p.parse_args(argv)
    if not args.check:
        for md, text in renderable():
            if not md.exists() or md.read_text() != text:
                md.write_text(text)
                print(f"wrote {md.relative_to(ROOT)}")
        for page in pages():
            text = page.read_text()
            written = with_tables(text)
            if written != text:
                page.write_text(written)
                print(f"wrote the tables of {page.relative_to(ROOT)}")
    problems = stale_results() + [p for page in pages() for p in
                                  stale_tables(page) + unsourced(page) + misquoted(page)]
    problems += [p for page in taught_pages() for p in stray_sources(page)]
    print("\n".join(problems) if problems else "every figure is in its results file")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
