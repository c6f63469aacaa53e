"""Does each exercise's grader discriminate? (`make exercises-check`, CI.)

For every exercise (01..06, chapter 07's 07a and 07b, 08, 09, chapter 10's
10a and 10b: EXERCISES in tests/components.py):

- the grading tests (`-m exNN`) run on the untouched stubs of
  `NN-*/exercises/` (`--exercise NN`), where every one must fail, and fail
  because of the stub (NotImplementedError), not because of a broken test;
- each of the exercise's named bugs (tests/named_bugs.py: the reference
  with one mistake learners make) is graded as a learner's file
  (`--exercise-file`): the grading tests must fail, not on a stub, and the
  first failure must send the learner to the README hint the bug is about
  (`Think about hint N`), not to the answer. These runs stop at the first
  failure (`-x`; the tests that need no model run first) and do not shrink
  hypothesis' examples (`HYPOTHESIS_PROFILE=fail-fast`).

That the same tests pass on the reference is what `make test` shows (they
are part of it, so CI does not run them twice); `--reference` checks it
here too (what `make exercise CH=NN REFERENCE=1` runs, for every exercise).

    python -m tests.check_exercises                 # every exercise's stub
    python -m tests.check_exercises 04 07a          # some
    python -m tests.check_exercises --reference     # and the references
    python -m tests.check_exercises --bugs-only 04  # only the named bugs
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.components import EXERCISES
from tests.named_bugs import NamedBug, bugs_for

ROOT = Path(__file__).resolve().parents[1]


def preload() -> None:
    """Import once what every grading run imports (torch, transformers,
    the engine): each run is then a child forked from this process, not a
    fresh interpreter (about 10 s saved per run on 2 cores). Nothing here
    runs a torch operation, so forking is safe."""
    import hypothesis  # noqa: F401
    import pytest  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import bench.loadtest  # noqa: F401
    import common.engine.llm_engine  # noqa: F401
    import common.loader  # noqa: F401


def pytest_in_forks(runs: list[list[str]], workers: int = 2) -> list[str]:
    """`pytest args` for each args of `runs`, each in a forked child, at
    most `workers` at a time (the 2 cores: most grading tests are Python
    that keeps one core busy); returns what each printed, in order."""
    outputs: list[str] = [""] * len(runs)
    running: dict[int, tuple[int, object]] = {}  # pid -> (index, its output file)
    pending = list(enumerate(runs))
    while pending or running:
        while pending and len(running) < workers:
            index, args = pending.pop(0)
            out = tempfile.TemporaryFile(mode="w+")
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child
                code = 99
                try:
                    os.dup2(out.fileno(), 1)
                    os.dup2(out.fileno(), 2)
                    os.chdir(ROOT)
                    import pytest
                    code = int(pytest.main(args))
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            running[pid] = (index, out)
        pid, _ = os.wait()
        index, out = running.pop(pid)
        out.seek(0)
        outputs[index] = out.read()
        out.close()
    return outputs


def grading_files(chapter: str) -> list[str]:
    """The test files that hold exercise `chapter`'s grading tests: only
    these are collected (collecting all of tests/ costs seconds a run)."""
    mark = re.compile(rf"\bex{chapter}\b")
    return [str(path.relative_to(ROOT)) for path in sorted((ROOT / "tests").glob("test_*.py"))
            if mark.search(path.read_text())]


def run_grading(chapter: str, stub: bool) -> list[ET.Element]:
    """The chapter's grading tests, on the stub or on the reference: their
    JUnit test cases."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        exercise = ["--exercise", chapter] if stub else []
        pytest_in_forks([["-m", f"ex{chapter}", *exercise, "-q", "--no-header", "-p",
                          "no:warnings", f"--junitxml={report}", *grading_files(chapter)]])
        return list(ET.parse(report).getroot().iter("testcase"))


def check_bugs(bugs: list[NamedBug]) -> list[str]:
    """Grade the reference with each bug planted, as a learner's file."""
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for number, bug in enumerate(bugs):
            folder = Path(tmp) / str(number)
            folder.mkdir()
            planted = folder / bug.reference.name
            planted.write_text(bug.patched_source())
            runs.append(["-m", f"ex{bug.exercise}", "--exercise", bug.exercise,
                         f"--exercise-file={planted}", "-x", "-q", "--no-header", "-p",
                         "no:warnings", "--tb=line", f"--junitxml={folder / 'report.xml'}",
                         *([f"tests/{bug.caught_by}"] if bug.caught_by
                           else grading_files(bug.exercise))])
        printed = pytest_in_forks(runs)
        problems = []
        for number, (bug, output) in enumerate(zip(bugs, printed)):
            report = Path(tmp) / str(number) / "report.xml"
            cases = list(ET.parse(report).getroot().iter("testcase")) if report.exists() else []
            problems += judge_bug(bug, cases, output)
    return problems


def judge_bug(bug: NamedBug, cases: list[ET.Element], printed: str) -> list[str]:
    """Problems with one named bug's grading run (none: it was caught)."""
    failures = [(case, found) for case in cases for kind, found in [outcome(case)]
                if kind in ("failure", "error")]
    if not failures:
        by = f" ({bug.caught_by})" if bug.caught_by else ""
        return [f"named bug '{bug.name}' passes the grading tests{by}"]
    case, found = failures[0]
    text = found.get("message", "") + (found.text or "")
    if "NotImplementedError" in text:
        return [f"named bug '{bug.name}': {case.get('name')} fails on a stub, not on the bug"]
    pointed = re.search(r"Think about hint (\d+)", printed)
    if pointed is None:
        return [f"named bug '{bug.name}': {case.get('name')} fails without pointing at a hint"]
    if int(pointed.group(1)) != bug.hint:
        return [f"named bug '{bug.name}': {case.get('name')} points at hint {pointed.group(1)}, "
                f"the bug is about hint {bug.hint}"]
    print(f"    caught: {bug.name} ({case.get('name')}, hint {bug.hint})", flush=True)
    return []


def outcome(case: ET.Element) -> tuple[str, ET.Element | None]:
    for kind in ("failure", "error", "skipped"):
        found = case.find(kind)
        if found is not None:
            return kind, found
    return "passed", None


def check(chapter: str, reference: bool) -> list[str]:
    """Problems found: a grading test that passes on the stub, or fails on
    the stub for another reason, or (`reference`) fails on the reference."""
    problems = []
    for case in run_grading(chapter, stub=False) if reference else []:
        kind, _ = outcome(case)
        if kind != "passed":
            problems.append(f"{case.get('name')}: {kind} on the reference")
    cases = run_grading(chapter, stub=True)
    for case in cases:
        kind, found = outcome(case)
        name = case.get("name")
        if kind == "passed":
            problems.append(f"{name} passes on the untouched stub")
        elif "NotImplementedError" not in (found.get("message", "") + (found.text or "")):
            problems.append(f"{name} fails on the stub for another reason: "
                            f"{found.get('message')}")
    if not cases:
        problems.append(f"no grading test is marked ex{chapter}")
    return problems


def main(args: list[str]) -> int:
    reference = "--reference" in args
    bugs_only = "--bugs-only" in args
    chapters = [a for a in args if not a.startswith("--")] or list(EXERCISES)
    unknown = [c for c in chapters if c not in EXERCISES]
    if unknown:
        print(f"no such exercise: {', '.join(unknown)} (there are {', '.join(EXERCISES)})")
        return 2
    os.environ["HYPOTHESIS_PROFILE"] = "fail-fast"  # no shrinking: the first failure will do
    preload()
    failed = False
    for chapter in chapters:
        problems = [] if bugs_only else check(chapter, reference)
        bugs = bugs_for(chapter)
        problems += check_bugs(bugs)
        verdict = ", ".join(
            ([] if bugs_only else ["the stub fails every grading test"])
            + (["the reference passes them"] if reference and not bugs_only else [])
            + [f"{len(bugs)} named bugs are caught"])
        print(f"exercise {chapter}: " + (verdict if not problems
                                         else f"{len(problems)} problem(s)"), flush=True)
        for problem in problems:
            print("   ", problem)
        failed = failed or bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
