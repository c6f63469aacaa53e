"""Every word matches the code: the READMEs and slides quote only code that
exists, and name only results files that exist.

What a page quotes in `code spans` and code blocks is checked three ways:

- a path into the repository (`common/core/scheduler.py`,
  `bench/results/2026-11-30-vm.md`, `04-paged-attention/server.py`) must
  exist, and so must a module written with dots (`common.entrypoints.llm`);
- `Class.member` where Class is one of the course's classes: the member
  must be defined in that class or in a class it inherits from;
- any other identifier with an underscore (`merge_choices`,
  `num_computed_tokens`, `kv_waste_perc`) must appear in the course's
  Python as a whole name, or as a whole word inside a string or comment
  (JSON keys, flags); a Prometheus series (`_sum`, `_count`, `_bucket`,
  `_total`) may name its metric. Only inside a pytest `-k` expression may
  it be part of a name (`-k shared_prefix` selects a test by part of its
  name). A name from torch, transformers or the source material that the
  course's code does not use goes in EXTERNAL, with where it comes from.

The commands quoted are checked against the course's command lines (a
code block's line continued by `\\`, or by an indented `--flag` line, is
one command), and the links of the prose against the repository:

- a `--flag` on a line that runs one of the course's scripts
  (`python 05-continuous-batching/server.py`, `python -m bench.loadtest`)
  must be one of that script's argparse options, read from its source
  with ast (the `add_argument` calls it reaches, through `common/`'s
  parser builders), without importing torch; `bench.loadtest --chapter NN`
  also passes chapter NN's server flags on. `pytest` takes the options of
  tests/conftest.py, `vllm serve` chapter 06's (the real vLLM's that
  chapter 06 lacks go in EXTERNAL_FLAGS); other tools' lines (`curl`,
  `git`, `pip`, `mdp`, ...: EXTERNAL_COMMANDS) are left alone. A flag
  quoted on its own must be one of some course script's, or in
  EXTERNAL_FLAGS with where it comes from;
- `make TARGET KNOB=value`: the target must be a rule of the Makefile, and
  the knob a variable it reads (`KNOB ?= ...` or `$(KNOB)`);
- a markdown link or image with a relative target must point at an
  existing file, and its `#anchor` at a heading of the page it points at
  (GitHub's slugs).
"""
from __future__ import annotations

import ast
import re
import shlex
import tokenize
from functools import lru_cache
from pathlib import Path

import pytest

from common.entrypoints.chapters import later_flags
from pictures.make.figures import FENCE, ROOT
from pictures.make.figures import pages as learner_pages

pytestmark = pytest.mark.slides

PAGES = learner_pages()
COURSE_FOLDERS = ["common", "bench", "pictures", "tests",
                  *sorted(p.name for p in ROOT.glob("[0-9][0-9]-*"))]
# The course's own code only: not the virtual environments or llama.cpp's sources
# that `make` puts in hidden folders, nor this file, whose strings would vouch for anything.
CODE = [p for folder in COURSE_FOLDERS for p in (ROOT / folder).rglob("*.py")
        if p.name != "test_docs.py"]
CPP_CODE = [p for suffix in ("*.cpp", "*.h") for p in (ROOT / "common").rglob(suffix)]

# Names quoted on purpose that the course's own code never spells.
EXTERNAL = {
    # transformers / torch / Python
    "max_length", "max_new_tokens", "past_key_values", "torch_dtype", "do_sample",
    "flash_attn", "pad_token", "eos_token", "from_pretrained", "no_grad", "is_available",
    "save_pretrained", "flash_attn_varlen_func", "cuda_graph", "model_config",
    "paged_attention_v1", "reshape_and_cache", "block_tables_tensor", "max_num_partitions",
    "set_seed", "__init__", "__call__", "__main__", "input_length", "generated_tokens",
    "generated_text", "render_prompt", "chat_completions", "MODEL_ID",
    "top_logprobs_k", "torch_compile", "gpu_memory_utilization", "attribute_map",
    # OpenAI / vLLM fields and metrics quoted from their documentation
    "response_format", "tool_choice", "function_call", "web_search_options",
    "reasoning_effort", "best_of", "parallel_tool_calls", "max_completion_tokens",
    "include_usage", "stream_options", "finish_reason", "prompt_tokens", "total_tokens",
    "completion_tokens", "base_url", "api_key", "num_gpu_blocks", "enforce_eager",
    "swap_space", "tensor_parallel_size", "enable_chunked_prefill", "cpu_offload_gb",
    "completion_tokens_details", "prompt_tokens_details",
    # the real vLLM's own source and wire (.vllm-venv/.../vllm/), quoted in chapter 06
    "cpu_attention_with_kv_cache", "cpu_attn_reshape_and_cache",
    "dispatch_cpu_unquantized_gemm", "onednn_mm", "weight_packed_linear_cpu",
    "service_tier", "kv_transfer_params",
    # Prometheus configuration and PromQL; curl's --write-out
    "scrape_configs", "job_name", "static_configs", "histogram_quantile", "tokens_total",
    "http_code",
    # words of formulas and pseudo-code on the slides
    "bytes_per_element", "m_new",
}
# Flags quoted on purpose that no course script defines: other tools' flags quoted
# on their own, and the real `vllm serve`'s that chapter 08's server lacks.
EXTERNAL_FLAGS: set[str] = {
    # vLLM's engine arguments (docs.vllm.ai, "Engine Arguments"), quoted in chapters 05, 06
    "--max-num-partial-prefills", "--max-logprobs",
    # GuideLLM 0.8.1's `guidellm run` (bench/peers/guidellm_check.py builds the command)
    "--profile", "--constraint", "--data", "--tokenizer",
}
# Tools that are not the course's: the flags on their lines are left alone.
EXTERNAL_COMMANDS = {
    "curl", "git", "pip", "mdp", "source", "guidellm", "llama-server", "ray",
}
SPAN = re.compile(r"(`+)(.+?)\1", re.S)
PATH = re.compile(r"(?<![\w/.-])((?:common|bench|pictures|tests|\d\d-[a-z-]+)/[\w./*-]*[\w*])")
DOTTED_MODULE = re.compile(r"(?<![\w/.-])((?:common|bench|pictures|tests)(?:\.\w+)+)\b")
MEMBER = re.compile(r"\b([A-Z][A-Za-z0-9]+)\.([a-z_][a-z0-9_]*)\b")
SNAKE = re.compile(r"(?<![\w.:/-])([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\b(?![/-])")
K_EXPRESSION = re.compile(r"(?<!\S)-k\s*(\"[^\"]*\"|'[^']*'|\S+)")  # pytest -k
FLAG = re.compile(r"(?<![\w<>/.=-])(--[a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?![\w>-])")
COMMENT = re.compile(r"(?:^|\s)#(?:\s.*|$)")
SEGMENTS = re.compile(r"\s*(?:&&|\|\||;|\||&(?!\S))\s*")  # one command each
ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=\S*")
WRAPPERS = {"$", "(", "nice", "timeout", "time", "env", "exec", "then", "do"}
LINK = re.compile(r"!?\[([^\]]*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def quoted(path: Path, commands: bool = False) -> list[tuple[int, str]]:
    """(line number, text) of the code a page quotes: spans and blocks.

    A span may wrap across the lines of a paragraph (not across a table
    row or a heading). With `commands`, only blocks of shell or of no
    language count (not ```python or ```text pseudo-code), and a line
    continued by a trailing backslash, or by an indented line that starts
    with a flag (how the slides wrap a command), is one line, numbered by
    its first."""
    found: list[tuple[int, str]] = []
    in_block, paragraph, shell = False, [], True
    continued = False  # the block's previous line may continue

    def end_paragraph() -> None:
        text = "\n".join(line for _, line in paragraph)
        for m in SPAN.finditer(text):
            number = paragraph[0][0] + text.count("\n", 0, m.start())
            found.append((number, re.sub(r" *\n *", " ", m.group(2))))
        paragraph.clear()

    for number, line in enumerate(path.read_text().splitlines(), 1):
        if fence := FENCE.match(line):
            end_paragraph()
            in_block, continued = not in_block, False
            shell = line[fence.end():].strip() in ("", "bash", "sh", "shell", "console")
            continue
        if in_block:
            if commands and not shell:
                continue
            if commands and continued and (
                    found[-1][1].endswith("\\") or re.match(r"\s+-", line)):
                first, text = found.pop()
                found.append((first, text.rstrip("\\").rstrip() + " " + line.strip()))
            else:
                found.append((number, line))
            continued = bool(line.strip())
        elif not line.strip() or re.match(r" {0,3}(#|\|)", line):
            end_paragraph()  # a blank line, a heading or a table row ends a paragraph
            paragraph.append((number, line))
            end_paragraph()
        else:
            paragraph.append((number, line))
    end_paragraph()
    return found


@lru_cache(maxsize=None)
def course_words() -> frozenset[str]:
    """Every name in the course's Python, every word inside its strings, and
    every name in its C++ kernels."""
    words = set()
    for path in CODE:
        with path.open("rb") as f:
            for token in tokenize.tokenize(f.readline):
                if token.type == tokenize.NAME:
                    words.add(token.string)
                elif token.type in (tokenize.STRING, tokenize.COMMENT):  # keys, shapes
                    words.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", token.string))
    for path in CPP_CODE:  # the C++ kernels: every identifier
        words.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", path.read_text()))
    return frozenset(words)


@lru_cache(maxsize=None)
def course_classes() -> dict[str, set[str]]:
    """Class name -> the names it defines (methods, class attributes, fields,
    `self.x` assignments), including those of the classes it inherits from
    within the course."""
    members: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for path in CODE:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            names = members.setdefault(node.name, set())
            bases.setdefault(node.name, []).extend(
                b.id for b in node.bases if isinstance(b, ast.Name))
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    for target in item.targets:
                        if isinstance(target, ast.Name):
                            names.add(target.id)
                        elif isinstance(target, ast.Attribute):
                            names.add(target.attr)

    def all_members(name: str, seen: frozenset = frozenset()) -> set[str]:
        result = set(members.get(name, ()))
        for base in bases.get(name, []):
            if base in members and base not in seen:
                result |= all_members(base, seen | {name})
        return result

    return {name: all_members(name) for name in members}


@lru_cache(maxsize=None)
def _module_defs(path: Path) -> tuple[dict, dict, ast.Module]:
    """A course file's functions by name, and the names it imports from
    other course files: name -> (file, name there)."""
    tree = ast.parse(path.read_text(), str(path))
    functions = {node.name: node for node in ast.walk(tree)
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    imports = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            base = ROOT.joinpath(*node.module.split("."))
            for source in (base.with_suffix(".py"), base / "__init__.py"):
                if source.exists():
                    for alias in node.names:
                        imports[alias.asname or alias.name] = (source, alias.name)
                    break
    return functions, imports, tree


def _option_strings(call: ast.Call) -> set[str]:
    """The `--flags` of one `add_argument` (or pytest's `addoption`) call,
    with `--no-x` where argparse.BooleanOptionalAction adds it."""
    flags = {arg.value for arg in call.args
             if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
             and arg.value.startswith("--")}
    for keyword in call.keywords:
        value = keyword.value
        name = value.attr if isinstance(value, ast.Attribute) else getattr(value, "id", "")
        if keyword.arg == "action" and name == "BooleanOptionalAction":
            flags |= {"--no-" + flag[2:] for flag in flags}
    return flags


@lru_cache(maxsize=None)
def script_flags(path: Path) -> frozenset[str]:
    """The `--flags` a course script's command line accepts, read from the
    source: the `add_argument` calls in the functions its top level reaches,
    following calls into the course's other files (a chapter's server
    -> run_chat_server -> server_parser -> add_engine_args), no torch
    imported. `--help` where it has any."""
    flags: set[str] = set()
    seen: set[tuple[Path, str]] = set()

    def visit(file: Path, body: list[ast.AST]) -> None:
        functions, imports, _ = _module_defs(file)
        for statement in body:
            for node in ast.walk(statement):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                if isinstance(func, ast.Attribute) and func.attr in ("add_argument", "addoption"):
                    flags.update(_option_strings(node))
                elif isinstance(func, ast.Name):
                    target = ((file, func.id) if func.id in functions
                              else imports.get(func.id))
                    if target and target not in seen:
                        seen.add(target)
                        other = _module_defs(target[0])[0].get(target[1])
                        if other is not None:
                            visit(target[0], other.body)

    tree = _module_defs(path)[2]
    visit(path, [node for node in tree.body
                 if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))])
    return frozenset(flags | {"--help"} if flags else flags)


def chapter_flags(script: Path) -> frozenset[str]:
    """A script's flags; for a chapter's server.py, without the flags of
    later chapters (its parser knows them, to refuse them by name)."""
    flags = script_flags(script)
    chapter = script.parent.name[:2]
    if script.name == "server.py" and chapter.isdigit():
        flags -= set(later_flags(chapter))
    return flags


@lru_cache(maxsize=None)
def pytest_flags() -> frozenset[str]:
    """The options tests/conftest.py adds to pytest's own."""
    tree = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    return frozenset(flag for node in ast.walk(tree) if isinstance(node, ast.Call)
                     and isinstance(node.func, ast.Attribute) and node.func.attr == "addoption"
                     for flag in _option_strings(node))


def _server(chapter: str) -> Path | None:
    found = sorted(ROOT.glob(f"0{chapter.lstrip('0')}-*/server.py"))
    return found[0] if chapter.isdigit() and found else None


@lru_cache(maxsize=None)
def every_script_flag() -> frozenset[str]:
    """What a `--flag` quoted on its own may be: any course script's."""
    scripts = [*ROOT.glob("[0-9][0-9]-*/*.py"), *ROOT.glob("bench/**/*.py"),
               *ROOT.glob("pictures/**/*.py"),
               *ROOT.glob("tests/*.py"),
               *(ROOT / "common/entrypoints" / f for f in ("router.py", "ray_replicas.py"))]
    return frozenset().union(pytest_flags(), *(script_flags(p) for p in scripts))


@lru_cache(maxsize=None)
def makefile() -> tuple[frozenset[str], frozenset[str]]:
    """The Makefile's targets (rules), and the variables it reads
    (`X ?= ...`, or `$(X)` anywhere)."""
    text = (ROOT / "Makefile").read_text()
    targets = set()
    for m in re.finditer(r"^([^\s:=#.$][^:=#]*?)\s*::?(?!=)", text, re.M):
        targets.update(t for t in m.group(1).split() if "$" not in t and "%" not in t)
    knobs = set(re.findall(r"^\s*(?:export\s+)?([A-Za-z_]\w*)\s*\?=", text, re.M))
    knobs.update(re.findall(r"\$[({]([A-Za-z_]\w*)[)}]", text))
    knobs.update(re.findall(r"\$\(call given,([A-Za-z_]\w*),", text))
    return frozenset(targets), frozenset(knobs)


def command_of(words: list[str]) -> tuple[str, Path | str | None, int]:
    """What a command line runs: (kind, script, index of its first argument).

    kind is "script" (a course script: its path), "pytest", "vllm",
    "make", "external" (EXTERNAL_COMMANDS, python -m json.tool...) or
    "none" (no command: prose, output, a list of flags)."""
    i, wrapped = 0, False  # past VAR=value, `nice -n 19`, `timeout 60s`, a `$ ` prompt
    while i < len(words):
        if words[i] in WRAPPERS:
            wrapped = True
        elif not (ENV.fullmatch(words[i])
                  or (wrapped and re.fullmatch(r"-\w+|\d+[smh]?", words[i]))):
            break
        i += 1
    if i == len(words):
        return "none", None, i
    name = words[i].rsplit("/", 1)[-1]
    rest = words[i + 1:]
    if re.fullmatch(r"python(3(\.\d+)?)?", name):
        if rest[:1] == ["-m"] and len(rest) > 1:
            module = rest[1]
            if module == "pytest":
                return "pytest", None, i + 3
            if module.split(".")[0] == "vllm":
                return "vllm", None, i + 3
            script = ROOT.joinpath(*module.split(".")).with_suffix(".py")
            return ("script", script, i + 3) if script.exists() else ("external", module, i + 3)
        if rest and rest[0].endswith(".py"):
            script = ROOT / rest[0].removeprefix("./")
            return ("script", script, i + 2) if script.exists() else ("external", rest[0], i + 2)
        return "external", name, i + 1
    if name.endswith(".py") and (ROOT / words[i].removeprefix("./")).exists():
        return "script", ROOT / words[i].removeprefix("./"), i + 1
    if name in ("pytest", "vllm", "make"):
        return name, None, i + 1
    if name in EXTERNAL_COMMANDS:
        return "external", name, i + 1
    return "none", None, 0


def problems_of_commands(path: Path, label: str | None = None) -> list[str]:
    """Flags a command does not take, make targets and knobs the Makefile lacks."""
    targets, knobs = makefile()
    found = []
    for number, line in quoted(path, commands=True):
        where = f"{label or path.relative_to(ROOT)}:{number}"
        line = line.strip()
        comment = COMMENT.search(line) or re.search(r"\s{2,}\S.*", line)  # or aligned notes
        code, comment = (line[:comment.start()], comment.group()) if comment else (line, "")
        bare = [m.group(1) for m in FLAG.finditer(comment)]  # a comment's flags: quoted alone
        for segment in SEGMENTS.split(code):
            try:
                words = shlex.split(segment)
            except ValueError:  # an unclosed quote: a command wrapped on a slide
                words = segment.split()
            kind, script, start = command_of(words)
            before, after = words[:start], words[start:]
            if "--" in after:  # the rest goes to another program
                after = after[:after.index("--")]
            bare += [f for w in before for f in FLAG.findall(w)]
            flags = [f for w in after for f in FLAG.findall(w) if w.startswith("--")]
            if kind == "make":
                for word in after:
                    if word.startswith("-"):
                        continue  # make's own options
                    if "=" in word:
                        knob = word.split("=", 1)[0]
                        if knob not in knobs:
                            found.append(f"{where}: make knob {knob} is not read by the Makefile")
                    elif re.fullmatch(r"[a-z][a-z0-9_.-]*", word) and word not in targets:
                        found.append(f"{where}: make target {word} is not in the Makefile")
                continue
            if kind == "script":
                accepted, owner = set(chapter_flags(script)), str(script.relative_to(ROOT))
                if "--chapter" in accepted and "parse_known_args" in script.read_text():
                    chapter = next((b for a, b in zip(after, after[1:]) if a == "--chapter"), "")
                    if (server := _server(chapter)) is not None:  # passed on to its server
                        accepted |= chapter_flags(server)
            elif kind == "pytest":
                accepted, owner = set(pytest_flags()) | EXTERNAL_FLAGS, "pytest"
            elif kind == "vllm":
                accepted = set(chapter_flags(_server("08"))) | EXTERNAL_FLAGS
                owner = "vllm serve (chapter 08's server)"
            elif kind == "external":
                continue
            else:  # no command: prose, a server's output, a list of flags
                bare += FLAG.findall(segment)
                continue
            found += [f"{where}: {flag} is not a flag of {owner}"
                      for flag in flags if flag.split("=")[0] not in accepted]
        found += [f"{where}: {flag} is no course script's flag (EXTERNAL_FLAGS?)"
                  for flag in bare if flag not in every_script_flag() | EXTERNAL_FLAGS]
    return found


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text (no markup) in lower case,
    punctuation dropped but for `-` and `_`, each space a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>|[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    """The anchors of a page's headings (a repeated one gets -1, -2, ...)."""
    found, in_block = set(), False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_block = not in_block
        elif not in_block and (m := re.match(r" {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$", line)):
            slug, n = github_slug(m.group(1)), 1
            while slug in found:
                slug, n = f"{github_slug(m.group(1))}-{n}", n + 1
            found.add(slug)
        found.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line))
    return frozenset(found)


def problems_of_links(path: Path, label: str | None = None) -> list[str]:
    """Relative links and images to missing files or headings."""
    lines, in_block = [], False
    for line in path.read_text().splitlines():  # the prose: no code blocks, no spans
        if FENCE.match(line):
            in_block = not in_block
            line = ""
        lines.append("" if in_block else line)
    text = re.sub(r"(`+)(?:(?!\n\s*\n).)+?\1",  # a span, within its paragraph
                  lambda m: re.sub(r"[^\n]", " ", m.group()), "\n".join(lines), flags=re.S)
    found = []
    for m in LINK.finditer(text):
        where = f"{label or path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
        target = m.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        page = (path.parent / file).resolve() if file else path
        if not page.exists():
            found.append(f"{where}: link target {file} does not exist")
        elif anchor and page.suffix == ".md" and anchor not in anchors(page):
            found.append(f"{where}: link anchor #{anchor} is not a heading of "
                         f"{file or 'this page'}")
    return found


def problems(path: Path, label: str | None = None) -> list[str]:
    words, classes = course_words(), course_classes()
    found = []
    for number, text in quoted(path):
        where = f"{label or path.relative_to(ROOT)}:{number}"
        for match in PATH.finditer(text):
            target = match.group(1).rstrip(".")
            if "*" in target or "<" in target:
                continue  # a pattern, not a file
            if not (ROOT / target).exists():
                found.append(f"{where}: {target} does not exist")
        for match in DOTTED_MODULE.finditer(text):
            parts = match.group(1).split(".")
            for end in range(len(parts), 1, -1):  # the longest prefix that is a module
                base = ROOT.joinpath(*parts[:end])
                if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
                    break
            else:
                found.append(f"{where}: module {match.group(1)} does not exist")
        for match in MEMBER.finditer(text):
            cls, member = match.groups()
            if cls in classes and member not in classes[cls]:
                found.append(f"{where}: {cls}.{member} is not defined in {cls}")
        k_expressions = [m.span(1) for m in K_EXPRESSION.finditer(text)]
        for match in SNAKE.finditer(text):
            name = match.group(1)
            base = re.sub(r"_(sum|count|bucket|total)$", "", name)  # Prometheus' series names
            if name in words or base in words or name in EXTERNAL:
                continue
            if (any(start <= match.start() < end for start, end in k_expressions)
                    and any(name in word for word in words)):
                continue  # pytest -k selects tests by part of their names
            found.append(f"{where}: `{name}` is not in the course's code")
    return found + problems_of_commands(path, label) + problems_of_links(path, label)


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", PAGES, ids=[_name(p) for p in PAGES])
def test_pages_quote_only_code_that_exists(path: Path) -> None:
    found = problems(path)
    assert not found, f"{len(found)} stale quote(s) in {_name(path)}:\n" + "\n".join(found)


def planted_problems(page: Path) -> set[str]:
    """What the lint says of a scratch page, without its "page.md:N: " prefix."""
    return {found.split(": ", 1)[1] for found in problems(page, "page.md")}


def test_the_lint_catches_a_stale_quote(tmp_path: Path) -> None:
    """Quotes that were stale once, one of each kind."""
    page = tmp_path / "page.md"
    page.write_text("`merge_deltas` keeps `sent_text` per choice, see\n"
                    "`common/openai_api.py` and `common.engine_server`;\n"
                    "`OpenAIServing.final_outputs` and `AsyncLLM.generate`.\n"
                    "File: `bench/results/1999-01-01-vm.md`.\n")
    found = planted_problems(page)
    assert found == {
        "`merge_deltas` is not in the course's code",
        "`sent_text` is not in the course's code",
        "common/openai_api.py does not exist",
        "module common.engine_server does not exist",
        "OpenAIServing.final_outputs is not defined in OpenAIServing",
        "bench/results/1999-01-01-vm.md does not exist",
    }


def test_the_lint_catches_a_stale_flag(tmp_path: Path) -> None:
    """A flag its command does not take: a chapter's server, a course script
    (with the flags bench.loadtest passes on to chapter NN's server),
    pytest, `vllm serve`; a flag quoted alone that no course script takes.
    Other tools' lines (curl) are left alone."""
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\n"
        "python 05-continuous-batching/server.py --port 8000 --max-num-seq 8\n"
        "python 02-minimal-pytorch-inference/server.py --max-waiting 4   # chapter 06's\n"
        ".venv/bin/python -m bench.loadtest --chapter 04 --clients 8 \\\n"
        "  --enable-prefix-caching --prefix-caching\n"
        "vllm serve Qwen/Qwen2.5-0.5B-Instruct --max-num-seqs 64\n"
        "    --max-num-partial-prefills 2 --swap-space 4\n"
        "curl -s --no-buffer localhost:8000/health\n"
        "```\n"
        "Chapter 06 takes `--max-waitng`; `python -m bench.bench --peer vllm`;\n"
        "`pytest -m ex04 --exercise 04 --exercice 04`.\n")
    found = planted_problems(page)
    assert found == {
        "--max-num-seq is not a flag of 05-continuous-batching/server.py",
        "--max-waiting is not a flag of 02-minimal-pytorch-inference/server.py",
        "--prefix-caching is not a flag of bench/loadtest.py",
        "--swap-space is not a flag of vllm serve (chapter 08's server)",
        "--max-waitng is no course script's flag (EXTERNAL_FLAGS?)",
        "--peer is not a flag of bench/bench.py",
        "--exercice is not a flag of pytest",
    }


def test_the_lint_catches_a_stale_make_target_or_knob(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Run `make bench-peers` (now `make bench PEERS=1`), then\n"
        "`make loadtest CH=05 CLIENT=32` and `make serve CH=02 CARD=1.1`.\n"
        "```\n"
        "make vllm-serve PORT=8001 VLLM_KV_GB=2   # the real vLLM\n"
        "make bench QUIK=1                        chapter by chapter\n"
        "```\n"
        "```text\n"
        "make room for its newest token           (pseudo-code, not a command)\n"
        "```\n")
    found = planted_problems(page)
    assert found == {
        "make target bench-peers is not in the Makefile",
        "make knob CLIENT is not read by the Makefile",
        "make knob QUIK is not read by the Makefile",
    }


def test_the_lint_catches_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text(
        "# Our engine next to vLLM: `make bench PEERS=vllm`\n\n## Setup\n\n## Setup\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#our-engine-next-to-vllm-make-bench-peersvllm),\n"
        "[the second Setup](other.md#setup-1), [here](#links), [web](https://example.com/#x),\n"
        "[gone](missing.md), [stale](other.md#the-finished-engine), [no](#nowhere),\n"
        "![figure](figs/chapters.png), `[in code](not-checked.md)`.\n"
        "\n# Links\n")
    found = planted_problems(page)
    assert found == {
        "link target missing.md does not exist",
        "link anchor #the-finished-engine is not a heading of other.md",
        "link anchor #nowhere is not a heading of this page",
        "link target figs/chapters.png does not exist",
    }


def test_the_lint_takes_no_part_of_a_name_for_the_name(tmp_path: Path) -> None:
    """`num_computed` is part of `num_computed_tokens`, not a name of the
    course; only a pytest -k expression selects by part of a name."""
    page = tmp_path / "page.md"
    page.write_text(
        "`min(bs, num_computed - j * bs)`\n"
        "the `hashed_once` test\n"
        "`-k shared_prefix` and `pytest -m ex04 -k \"hashed_once or tiny\"`\n"
        "`vllm:time_to_first_token_seconds_bucket`, `time_to_first_token_seconds_sum`\n"
        "`grep -E '(time_to_first_token|inter_token_latency)_seconds'`\n")
    found = set(problems(page, "page.md"))
    assert found == {
        "page.md:1: `num_computed` is not in the course's code",
        "page.md:2: `hashed_once` is not in the course's code",
        "page.md:5: `time_to_first_token` is not in the course's code",
        "page.md:5: `inter_token_latency` is not in the course's code",
    }
