"""Does each exercise's grader discriminate? (`make exercises-check`, CI.)

For every chapter, the grading tests (`-m exNN`) run on the untouched stubs
of `NN-*/exercises/` (`--exercise NN`): every one of them must fail, and
each must fail because of the stub (NotImplementedError), not because of
a broken test. The same tests passing on the reference is what `make test`
shows (they are part of it), and `make exercise CH=NN REFERENCE=1` runs
just them.

    python -m tests.check_exercises            # every chapter
    python -m tests.check_exercises 04 05      # some
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.components import EXERCISES

ROOT = Path(__file__).resolve().parents[1]


def grade_stub(chapter: str) -> list[str]:
    """Problems found: grading tests that pass, or fail for another reason."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-m", f"ex{chapter}", "--exercise",
                        chapter, "-q", "--no-header", "-p", "no:warnings",
                        f"--junitxml={report}"], cwd=ROOT, capture_output=True, text=True)
        cases = ET.parse(report).getroot().iter("testcase")
        problems, count = [], 0
        for case in cases:
            count += 1
            name = f"{case.get('classname')}::{case.get('name')}"
            failure = case.find("failure")
            if failure is None:
                failure = case.find("error")
            if failure is None:
                problems.append(f"{name} passes on the untouched stub")
            elif "NotImplementedError" not in (failure.get("message", "") + (failure.text or "")):
                problems.append(f"{name} fails for another reason: {failure.get('message')}")
        if count == 0:
            problems.append(f"no grading test is marked ex{chapter}")
        return problems


def main(chapters: list[str]) -> int:
    failed = False
    for chapter in chapters or list(EXERCISES):
        problems = grade_stub(chapter)
        print(f"exercise {chapter}: " + ("every grading test fails on the stub, as it should"
                                         if not problems else f"{len(problems)} problem(s)"))
        for problem in problems:
            print("   ", problem)
        failed = failed or bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
