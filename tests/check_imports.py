"""The import budget: what each chapter's engine really loads.

    python -m tests.check_imports            # the table: chapter by module (make imports)
    python -m tests.check_imports 05 09      # some chapters only
    python -m tests.check_imports --readme   # the README's chapter table, from the same table
    python -m tests.check_imports --write-pages   # each chapter README's list, from it too

For each chapter, a fresh interpreter runs the chapter's `server.py` as a
learner does, with its default flags, except that the server answers one
chat request through FastAPI's test client instead of listening; then,
from chapter 05 on (the offline `LLM` is chapter 05's), it builds the
chapter's offline `LLM` and generates. What it prints is every module of
`common` that was loaded, and the libraries that belong to a chapter
(`LIBRARY_CHAPTERS`).

The table it checks against is `MODULE_CHAPTERS`
(common/entrypoints/chapters.py): a chapter may load only modules of its
own chapter or earlier ones. tests/test_import_budget.py runs it for
every chapter.

Left out: flags other than the defaults (`--tensor-parallel-size 2` loads
chapter 08's worker processes; `--kv-events-config` ZeroMQ), which the
tests check where they test those flags.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from common.entrypoints.chapters import (CHAPTER_FOLDERS, CHAPTER_SUMMARY, LIBRARY_CHAPTERS,
                                         MODULE_CHAPTERS, module_chapter)

ROOT = Path(__file__).resolve().parents[1]
FIRST_OFFLINE = "05"  # the offline LLM is chapter 05's

PROBE = textwrap.dedent("""
    import json, runpy, sys
    chapter, folder, offline, libraries = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4:]
    from common.entrypoints import launcher

    def one_request(app, args, engine=None):
        from fastapi.testclient import TestClient
        with TestClient(app) as client:
            answer = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            assert answer.status_code == 200, answer.text
        if engine is not None:
            engine.close()
        return 0

    launcher.serve = one_request  # bound by each server's `from ... import serve`
    sys.argv = [f"{folder}/server.py"]
    try:
        runpy.run_path(f"{folder}/server.py", run_name="__main__")
    except SystemExit as exc:
        assert not exc.code, f"server.py exited with {exc.code}"
    if offline:
        from common.entrypoints.llm import LLM
        from common.sampling_params import SamplingParams
        llm = LLM(chapter=chapter)
        [out] = llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 2
        llm.engine.close()
    loaded = sorted(m for m in sys.modules
                    if m == "common" or m.startswith("common.") or m in libraries)
    print("LOADED " + json.dumps(loaded))
""")


def loaded_modules(chapter: str) -> list[str]:
    """The modules of `common` (and the chapter libraries) that chapter
    `chapter`'s server and offline LLM load, in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    offline = "1" if chapter >= FIRST_OFFLINE else "0"
    result = subprocess.run(
        [sys.executable, "-c", PROBE, chapter, CHAPTER_FOLDERS[chapter], offline,
         *LIBRARY_CHAPTERS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("LOADED ")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"chapter {chapter}'s probe failed ({result.returncode}):\n"
                           f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("LOADED "))


def over_budget(chapter: str, loaded: list[str]) -> list[str]:
    """What `chapter` loaded that a later chapter adds (or that the table lacks)."""
    found = []
    for name in loaded:
        owner = module_chapter(name)
        if owner is None:
            found.append(f"{name}: not in MODULE_CHAPTERS")
        elif owner > chapter:
            found.append(f"{name}: chapter {owner}'s")
    return found


def table(rows: dict[str, list[str]]) -> str:
    """Chapter by module: `x` where the chapter loads it, `+` where it is new."""
    chapters = sorted(rows)
    names = sorted(set().union(*rows.values()),
                   key=lambda m: (module_chapter(m) or "99", m))
    width = max(len(n) for n in names)
    lines = [f"{'module':<{width}}  table  " + "  ".join(chapters)]
    for name in names:
        cells = []
        for chapter in chapters:
            mark = "." if name not in rows[chapter] else (
                "+" if module_chapter(name) == chapter else "x")
            cells.append(f"{mark:>2}")
        lines.append(f"{name:<{width}}  {module_chapter(name) or '??':>5}  " + "  ".join(cells))
    return "\n".join(lines)


def added_by(chapter: str) -> tuple[list[str], list[str]]:
    """The modules (a package counts by its modules) and the libraries
    that the table gives `chapter`."""
    modules = [name for name, owner in sorted(MODULE_CHAPTERS.items())
               if owner == chapter and name not in FOLDERS]
    libraries = [name for name, owner in sorted(LIBRARY_CHAPTERS.items()) if owner == chapter]
    return modules, libraries


def modules_added(chapter: str) -> str:
    """The modules of common/ a chapter adds, by package, as the README lists them."""
    modules, libraries = added_by(chapter)
    by_package: dict[str, list[str]] = {}
    for name in modules:
        *package, module = name.split(".")[1:]
        by_package.setdefault("/".join(package), []).append(module)
    groups = [(f"`{package}/` " if package else "") + ", ".join(names)
              for package, names in sorted(by_package.items())]
    return "; ".join(groups + ([f"uses {', '.join(libraries)}"] if libraries else [])) or "-"


FOLDERS = {name for name in MODULE_CHAPTERS if (ROOT / name.replace(".", "/")).is_dir()}
README_HEADER = ["| chapter | the component it adds | modules of `common/` it adds | run it |",
                 "|---|---|---|---|"]


def readme_table() -> str:
    """The root README's chapter table: CHAPTER_SUMMARY's words, MODULE_CHAPTERS' modules."""
    lines = list(README_HEADER)
    for chapter, (name, adds, run) in sorted(CHAPTER_SUMMARY.items()):
        folder = CHAPTER_FOLDERS[chapter]
        lines.append(f"| [{chapter} {name}]({folder}/README.md) | {adds} | "
                     f"{modules_added(chapter)} | `{run}` |")
    return "\n".join(lines)


PAGE_START = "<!-- modules: generated by `python -m tests.check_imports --write-pages` -->"
PAGE_END = "<!-- /modules -->"
PAGE_HEADING = "## What this chapter adds to `common/`"


def page_block(chapter: str) -> str:
    """A chapter README's generated list: the modules the table gives it."""
    modules, libraries = added_by(chapter)
    paths = ", ".join(f"`{name.replace('.', '/')}.py`" for name in modules) or "none"
    line = (f"By the import budget's table (`MODULE_CHAPTERS` in "
            f"`common/entrypoints/chapters.py`), this chapter's server is the first to load: "
            f"{paths}" + (f"; and the libraries {', '.join(libraries)}" if libraries else "")
            + ".")
    return f"{PAGE_START}{line}{PAGE_END}"


def write_page(chapter: str) -> bool:
    """Put (or refresh) the generated list under the README's heading;
    returns whether the page changed."""
    path = ROOT / CHAPTER_FOLDERS[chapter] / "README.md"
    text = path.read_text()
    if PAGE_START in text:
        start, end = text.index(PAGE_START), text.index(PAGE_END) + len(PAGE_END)
        new = text[:start] + page_block(chapter) + text[end:]
    else:
        heading = text.index(PAGE_HEADING)
        line_end = text.index("\n", heading)
        new = text[:line_end + 1] + page_block(chapter) + "\n" + text[line_end + 1:]
    path.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chapters", nargs="*", default=sorted(CHAPTER_FOLDERS))
    parser.add_argument("--readme", action="store_true", help="print the README's table")
    parser.add_argument("--write-pages", action="store_true",
                        help="write each chapter README's list of the modules it adds")
    args = parser.parse_args(argv)
    if args.readme:
        print(readme_table())
        return 0
    if args.write_pages:
        for chapter in sorted(CHAPTER_FOLDERS):
            print(CHAPTER_FOLDERS[chapter], "changed" if write_page(chapter) else "as it was")
        return 0
    rows, failed = {}, False
    for chapter in args.chapters:
        rows[chapter] = loaded_modules(chapter)
        for problem in over_budget(chapter, rows[chapter]):
            print(f"chapter {chapter}: {problem}")
            failed = True
    print(table(rows))
    print(f"\n{len(MODULE_CHAPTERS)} modules in the table; "
          "+ a chapter's own, x an earlier chapter's, . not loaded")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
