"""Every word matches the code: the READMEs and slides quote only code that
exists, and name only results files that exist.

What a page quotes in `code spans` and code blocks is checked three ways:

- a path into the repository (`common/engine/scheduler.py`,
  `bench/results/2026-11-30-vm.md`, `04-paged-attention/server.py`) must
  exist, and so must a module written with dots (`common.entrypoints.llm`);
- `Class.member` where Class is one of the course's classes: the member
  must be defined in that class or in a class it inherits from;
- any other identifier with an underscore (`merge_choices`,
  `num_computed_tokens`, `kv_waste_perc`) must appear somewhere in the
  course's Python, as a name or inside a string (JSON keys, flags), or
  be part of one (`-k shared_prefix` selects a test by part of its name). A name
  from torch, transformers or the source material that the course's code
  does not use goes in EXTERNAL, with where it comes from.
"""
from __future__ import annotations

import ast
import re
import tokenize
from functools import lru_cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.slides

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *ROOT.glob("bench/README.md"), *ROOT.glob("0*/README.md"),
                *ROOT.glob("0*/slides.md"), *ROOT.glob("0*/exercises/*.md")])
COURSE_FOLDERS = ["common", "bench", "tests", *sorted(p.name for p in ROOT.glob("0*"))]
# The course's own code only: not the virtual environments or llama.cpp's sources
# that `make` puts in hidden folders, nor this file, whose strings would vouch for anything.
CODE = [p for folder in COURSE_FOLDERS for p in (ROOT / folder).rglob("*.py")
        if p.name != "test_docs.py"]

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
SPAN = re.compile(r"(`+)(.+?)\1")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
PATH = re.compile(r"(?<![\w/.-])((?:common|bench|tests|0\d-[a-z-]+)/[\w./*-]*[\w*])")
DOTTED_MODULE = re.compile(r"(?<![\w/.-])((?:common|bench|tests)(?:\.\w+)+)\b")
MEMBER = re.compile(r"\b([A-Z][A-Za-z0-9]+)\.([a-z_][a-z0-9_]*)\b")
SNAKE = re.compile(r"(?<![\w.:/-])([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\b(?![/-])")


def quoted(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the code a page quotes: spans and blocks."""
    found, in_block = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_block = not in_block
            continue
        if in_block:
            found.append((number, line))
        else:
            found += [(number, m.group(2)) for m in SPAN.finditer(line)]
    return found


@lru_cache(maxsize=None)
def course_words() -> frozenset[str]:
    """Every name in the course's Python, and every word inside its strings."""
    words = set()
    for path in CODE:
        with path.open("rb") as f:
            for token in tokenize.tokenize(f.readline):
                if token.type == tokenize.NAME:
                    words.add(token.string)
                elif token.type in (tokenize.STRING, tokenize.COMMENT):  # keys, shapes
                    words.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", token.string))
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


def problems(path: Path, label: str | None = None) -> list[str]:
    words, classes = course_words(), course_classes()
    every_name = "\n".join(words)  # for parts of names
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
        for match in SNAKE.finditer(text):
            name = match.group(1)
            base = re.sub(r"_(sum|count|bucket|total)$", "", name)  # Prometheus' series names
            if base not in words and name not in EXTERNAL and base not in every_name:
                found.append(f"{where}: `{name}` is not in the course's code")
    return found


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", PAGES, ids=[_name(p) for p in PAGES])
def test_pages_quote_only_code_that_exists(path: Path) -> None:
    found = problems(path)
    assert not found, f"{len(found)} stale quote(s) in {_name(path)}:\n" + "\n".join(found)


def test_the_lint_catches_a_stale_quote(tmp_path: Path) -> None:
    """Quotes that were stale once, one of each kind."""
    page = tmp_path / "page.md"
    page.write_text("`merge_deltas` keeps `sent_text` per choice, see\n"
                    "`common/openai_api.py` and `common.engine_server`;\n"
                    "`OpenAIServing.final_outputs` and `AsyncLLM.generate`.\n"
                    "File: `bench/results/1999-01-01-vm.md`.\n")
    found = {f.split(": ", 1)[1] for f in problems(page, "page.md")}
    assert found == {
        "`merge_deltas` is not in the course's code",
        "`sent_text` is not in the course's code",
        "common/openai_api.py does not exist",
        "module common.engine_server does not exist",
        "OpenAIServing.final_outputs is not defined in OpenAIServing",
        "bench/results/1999-01-01-vm.md does not exist",
    }
