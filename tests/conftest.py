"""Shared fixtures: one loaded embedded model per test session, and chapter
servers started once per module on free ports (offline, CPU)."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run in the interpreter on CPU tensors; this must be set
    # before anything imports triton (transformers does).
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hypothesis import Phase, settings  # noqa: E402

from bench.loadtest import ChapterServer  # noqa: E402
from common.loader import load_model  # noqa: E402
from common.net import free_port  # noqa: E402

# Property tests (tests/test_*_invariants.py) stop at the first failing
# example instead of shrinking it (shrinking can take minutes on 2 cores);
# the invariant's message says what broke. `HYPOTHESIS_PROFILE=shrink`
# asks for the smallest example.
settings.register_profile("fail-fast", phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.register_profile("shrink")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fail-fast"))

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."},
     {"role": "user", "content": "Tell me about the sea in a few sentences."}],
    [{"role": "user", "content": "List three colors."}],
]


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct, float32 on the CPU."""
    return load_model("smollm2", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def tiny_llama():
    return load_model("tiny-llama", dtype="float32", device="cpu", load_format="dummy")


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF `model.generate`, greedy, stopping at EOS: the reference tokens.

    The attention mask is explicit: the pad token (2) is also <|im_end|>,
    which the chat template puts in every prompt.
    """
    import torch
    input_ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                         max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    """start_server("05", *args) -> a running ChapterServer, stopped at the
    end of the module that started it: a server holds its model and KV pool
    (1-3 GB), so the servers of earlier modules do not pile up in memory."""
    servers: list[ChapterServer] = []

    def start(chapter: str, *args: str) -> ChapterServer:
        if "--dtype" not in args:  # equivalence with HF's float32, whatever the CPU
            args = ("--dtype", "float32", *args)
        log = tmp_path_factory.mktemp(f"ch{chapter}") / "server.log"
        server = ChapterServer(chapter, free_port(), list(args), log)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def openai_client(url: str, strict: bool = True, **kwargs):
    """The official client, strict by default: any response field out of
    shape fails."""
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key=kwargs.pop("api_key", "none"),
                         max_retries=0, _strict_response_validation=strict, **kwargs)


def wait_for(condition, what: str, timeout: float = 120.0) -> None:
    """Poll until `condition()` holds. The test waits for an event, not for
    a time: the timeout only bounds a failure."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# ------------------------------------------------------------- exercises
def pytest_addoption(parser):
    parser.addoption("--exercise", metavar="CH", default=None,
                     help="grade the learner's component of exercise CH (01..06, 07a, 07b, 08, 09, "
                          "10a, 10b: "
                          "tests/components.py's EXERCISES, from NN-*/exercises/) instead "
                          "of the reference (make exercise CH=04)")
    parser.addoption("--skip-model-tests", action="store_true",
                     help="deselect the tests that load the embedded model or start a server "
                          "(mutation runs of the block manager and the scheduler: make mutants)")
    parser.addoption("--exercise-file", metavar="PATH", default=None, type=Path,
                     help="with --exercise: grade this file instead of the chapter's "
                          "exercise file (make exercises-check plants named bugs this way)")


@pytest.fixture(scope="session")
def impl(request):
    """The components under test: the reference, or (`--exercise CH`) the
    learner's for that chapter (tests/components.py)."""
    from tests.components import components_for
    return components_for(request.config.getoption("--exercise"),
                          request.config.getoption("exercise_file"))


def pytest_configure(config):
    chapter = config.getoption("--exercise")
    if chapter is not None:
        from tests.components import EXERCISES, exercise_path
        if chapter not in EXERCISES:
            raise pytest.UsageError(f"--exercise {chapter}: no such exercise "
                                    f"(there are {', '.join(EXERCISES)})")
        if not exercise_path(chapter).exists():
            raise pytest.UsageError(f"{exercise_path(chapter)} is missing")


MODEL_FIXTURES = {"embedded", "tiny_llama", "start_server"}


def pytest_collection_modifyitems(config, items):
    """In exercise mode the tests that need no model run first: a learner
    sees the quick, pointed failures before the end-to-end ones.
    `--skip-model-tests` leaves out those that load the embedded model or
    start a server."""
    if config.getoption("--skip-model-tests"):
        heavy = {"embedded", "start_server"}
        skipped = [item for item in items if heavy & set(item.fixturenames)]
        if skipped:
            config.hook.pytest_deselected(items=skipped)
            items[:] = [item for item in items if not heavy & set(item.fixturenames)]
    if config.getoption("--exercise") is not None:
        items.sort(key=lambda item: bool(MODEL_FIXTURES & set(item.fixturenames)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In exercise mode, say what to do next under each failed test: which
    of the exercise README's hints to read (tests/components.py's
    `hint_for`), never the answer."""
    outcome = yield
    report = outcome.get_result()
    chapter = item.config.getoption("--exercise")
    if chapter is None or not report.failed or call.excinfo is None:
        return
    from tests.components import exercise_path, hint_for
    where = exercise_path(chapter).relative_to(ROOT)
    doc = (item.obj.__doc__ or item.name.replace("_", " ")).strip()
    what = " ".join(doc.split("\n\n")[0].split())  # the docstring's first paragraph
    if call.excinfo.errisinstance(NotImplementedError):
        frame = call.excinfo.traceback[-1]
        advice = (f"`{frame.name}` in {where} is still a stub (NotImplementedError). "
                  f"Write it, then run `make exercise CH={chapter}` again.")
    else:
        hint = hint_for(chapter, item.originalname or item.name)
        think = (f"Think about hint {hint.number}, \"{hint.title}\", in {hint.readme}."
                 if hint else f"Read the hints in {hint_readme(chapter)}.")
        advice = (f"Your code in {where} ran, but this test expects otherwise: read the "
                  f"assertion above. {think} Run `make exercise CH={chapter}` again once "
                  "you have changed your code.")
    report.sections.append((f"exercise {chapter}", f"{item.name}: {what}\n{advice}"))


def hint_readme(chapter: str) -> str:
    from tests.components import readme_path
    return str(readme_path(chapter).relative_to(ROOT))


def pytest_terminal_summary(terminalreporter, config):
    chapter = config.getoption("--exercise")
    if chapter is None:
        return
    passed = len(terminalreporter.stats.get("passed", []))
    failed = len(terminalreporter.stats.get("failed", [])) + len(
        terminalreporter.stats.get("error", []))
    verdict = ("all of them pass: well done" if failed == 0 and passed
               else "keep going: the first failure above says what to write next")
    terminalreporter.write_line(
        f"exercise {chapter}: {passed} of {passed + failed} grading tests pass, {verdict}.")
