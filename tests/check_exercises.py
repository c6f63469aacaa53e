"""Does each exercise's grader discriminate? (`make exercises-check`, CI.)

For every exercise (01..06, chapter 07's 07a and 07b, and 08: EXERCISES in
tests/components.py), the grading tests (`-m exNN`) run on the untouched
stubs of `NN-*/exercises/` (`--exercise NN`), where every one must fail,
and fail because of the stub (NotImplementedError), not because of a
broken test. That the same tests pass on the reference is what `make test`
shows (they are part of it, so CI does not run them twice);
`--reference` checks it here too (what `make exercise CH=NN REFERENCE=1`
runs, for every exercise).

    python -m tests.check_exercises                 # every exercise's stub
    python -m tests.check_exercises 04 07a          # some
    python -m tests.check_exercises --reference     # and the references
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.components import EXERCISES

ROOT = Path(__file__).resolve().parents[1]


def run_grading(chapter: str, stub: bool) -> list[ET.Element]:
    """The chapter's grading tests, on the stub or on the reference: their
    JUnit test cases."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        exercise = ["--exercise", chapter] if stub else []
        subprocess.run([sys.executable, "-m", "pytest", "-m", f"ex{chapter}", *exercise, "-q",
                        "--no-header", "-p", "no:warnings", f"--junitxml={report}"],
                       cwd=ROOT, capture_output=True, text=True)
        return list(ET.parse(report).getroot().iter("testcase"))


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
    chapters = [a for a in args if a != "--reference"] or list(EXERCISES)
    unknown = [c for c in chapters if c not in EXERCISES]
    if unknown:
        print(f"no such exercise: {', '.join(unknown)} (there are {', '.join(EXERCISES)})")
        return 2
    failed = False
    for chapter in chapters:
        problems = check(chapter, reference)
        verdict = ("the stub fails every grading test" + (", the reference passes them"
                                                          if reference else ""))
        print(f"exercise {chapter}: " + (verdict if not problems
                                         else f"{len(problems)} problem(s)"), flush=True)
        for problem in problems:
            print("   ", problem)
        failed = failed or bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
