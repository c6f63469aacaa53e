"""The mutation-testing results (`make mutants CH=NN`, tests/mutation.py)
are there for every exercise's component, current, and meet the aim:
at least 90 % of the mutants killed, or every survivor explained.

Reads the results files only; the runs themselves take minutes each
(the files say how long) and are not part of `make test`. A run not
made yet is skipped, with the command that makes it. The named bugs
(tests/named_bugs.py) must still apply to the reference they patch.
"""
from __future__ import annotations

import re

import pytest

from tests.components import EXERCISES
from tests.mutation import RESULTS, TARGETS, source_digest
from tests.named_bugs import NAMED_BUGS

pytestmark = pytest.mark.layout

# The engine's own tests must meet the aim for these two as well.
ENGINE_SUITES = {"04", "05"}
RUNS = [(ex, "grading") for ex in EXERCISES] + [(ex, "engine") for ex in sorted(ENGINE_SUITES)]


def test_every_exercise_has_a_mutation_target():
    assert set(TARGETS) == set(EXERCISES)


@pytest.mark.parametrize("exercise, suite", RUNS, ids=[f"ex{e}-{s}" for e, s in RUNS])
def test_mutation_results_are_current_and_meet_the_aim(exercise, suite):
    path = RESULTS / f"mutants-ex{exercise}-{suite}.md"
    if not path.exists():
        pytest.skip(f"not measured yet: `make mutants CH={exercise} SUITE={suite}`")
    text = path.read_text()
    digest = re.search(r"sha256 ([0-9a-f]{16})", text).group(1)
    assert digest == source_digest(exercise), (
        f"{TARGETS[exercise].source} changed since {path.name} was written: "
        f"run `make mutants CH={exercise} SUITE={suite}` again")
    row = re.search(r"^\| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| ([\d.]+) \|", text, re.M)
    mutants, killed, survived, timeout, no_tests = map(int, row.groups()[:5])
    assert mutants == killed + survived + timeout + no_tests
    score = float(row.group(6))
    assert score == pytest.approx(100.0 * (killed + timeout) / (killed + survived + timeout), abs=0.05)
    unexplained = text.count("**Not explained**")
    equivalent = text.count("Equivalent: ")
    assert unexplained == 0, f"{path.name}: {unexplained} survivors not explained"
    assert equivalent == survived
    assert score >= 90.0 or survived == equivalent


@pytest.mark.parametrize("bug", NAMED_BUGS, ids=lambda b: f"{b.exercise}-{b.name}")
def test_named_bugs_still_apply_to_their_reference(bug):
    assert bug.patched_source() != bug.reference.read_text()
    assert bug.hint >= 1, "which README hint does this bug's failure point to?"
