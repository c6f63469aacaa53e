"""The folders draw the architecture; this test keeps the arrows pointing
one way.

    common/entrypoints   servers and the offline LLM
    common/engine        the engine: no web server, no entrypoint, no bench
    common/models        the forward passes and what depends on the model's
                         family: no engine
    common/layers        attention, sampling, parallel and quantized layers:
                         no model, no engine
    bench/               measurement: may import common/

Nothing under `common/` imports `bench/` (tests may), and no module of
`common/` takes part in an import cycle, lazy imports included.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.layout

ROOT = Path(__file__).resolve().parents[1]
ENGINE_LAYERS = ["common/engine", "common/layers", "common/models"]
WEB = ("fastapi", "uvicorn", "starlette", "prometheus_client", "openai")


def imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def offenders(folders: list[str], forbidden: tuple[str, ...], root: Path = ROOT) -> list[str]:
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for name in sorted(imports(path)):
                if name.split(".")[0] in forbidden or name.startswith(forbidden):
                    found.append(f"{path.relative_to(root)} imports {name}")
    return found


def test_the_engine_imports_no_server_no_entrypoint_no_bench():
    forbidden = WEB + ("common.entrypoints", "bench")
    assert offenders(ENGINE_LAYERS, forbidden) == []


def test_nothing_in_common_imports_bench():
    assert offenders(["common"], ("bench",)) == []


def test_the_layering_check_would_catch_an_offender(tmp_path):
    leaky = tmp_path / "common" / "engine"
    leaky.mkdir(parents=True)
    (leaky / "leaky.py").write_text("def f():\n    from fastapi import FastAPI\n"
                                    "from common.entrypoints.protocol import APIError\n")
    found = offenders(["common/engine"], WEB + ("common.entrypoints", "bench"), tmp_path)
    assert found == ["common/engine/leaky.py imports common.entrypoints.protocol",
                     "common/engine/leaky.py imports common.entrypoints.protocol.APIError",
                     "common/engine/leaky.py imports fastapi",
                     "common/engine/leaky.py imports fastapi.FastAPI"]


def test_layers_know_no_model_and_models_no_engine():
    assert offenders(["common/layers"], ("common.models", "common.engine")) == []
    assert offenders(["common/models"], ("common.engine",)) == []


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """common's modules -> the modules of common they import (a name such as
    `common.models.lm_head` counts as the module that defines it)."""
    paths = {module_name(p, root): p for p in sorted((root / "common").rglob("*.py"))}
    graph = {}
    for module, path in paths.items():
        targets = set()
        for name in imports(path):
            while name and name not in paths:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles, each as the path that closes it (depth-first)."""
    found, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_no_import_cycle_in_common():
    assert cycles(import_graph()) == []


def test_the_layering_checks_catch_a_planted_import_and_a_planted_cycle(tmp_path):
    layers, models = tmp_path / "common" / "layers", tmp_path / "common" / "models"
    layers.mkdir(parents=True)
    models.mkdir(parents=True)
    (tmp_path / "common" / "__init__.py").write_text("")
    (layers / "__init__.py").write_text("")
    (models / "__init__.py").write_text("")
    (layers / "leaky.py").write_text("from common.models import LLAMA_FAMILY\n")
    (models / "llama.py").write_text("def f():\n    from common.layers import leaky\n")
    assert offenders(["common/layers"], ("common.models",), tmp_path) == [
        "common/layers/leaky.py imports common.models",
        "common/layers/leaky.py imports common.models.LLAMA_FAMILY"]
    assert cycles(import_graph(tmp_path)) == []  # one way only so far
    (models / "__init__.py").write_text("from common.models.llama import f\n")
    (layers / "__init__.py").write_text("")
    (layers / "leaky.py").write_text("from common.models import f\n")
    assert cycles(import_graph(tmp_path)) == [
        ["common.layers.leaky", "common.models", "common.models.llama", "common.layers.leaky"]]


MAX_ENTRYPOINT_LINES = 300


def long_modules(folder: Path, most: int = MAX_ENTRYPOINT_LINES) -> list[str]:
    return [f"{path.name}: {n} lines" for path in sorted(folder.glob("*.py"))
            if (n := len(path.read_text().splitlines())) > most]


def test_the_serving_layer_is_one_concern_per_short_module(tmp_path):
    """The serving layer is composed, not flagged: no module of
    common/entrypoints over 300 lines, and no base-class hook left for a
    chapter to fill (`NotImplementedError`); the check sees a planted one."""
    folder = ROOT / "common/entrypoints"
    assert long_modules(folder) == []
    hooks = [p.name for p in folder.glob("*.py") if "NotImplementedError" in p.read_text()]
    assert hooks == []
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_ENTRYPOINT_LINES + 1))
    assert long_modules(tmp_path) == [f"big.py: {MAX_ENTRYPOINT_LINES + 1} lines"]
