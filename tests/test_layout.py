"""The folders draw the architecture; this test keeps the arrows pointing
down, one floor at a time (vLLM v1's map):

    6  common/entrypoints    servers, the offline LLM, the router
    5  common/engine         LLMEngine and its fronts: no web server
    4  common/spec_decode, common/structured_output, common/metrics,
       common/lora           the engine's plug-ins: drafts, grammars, step
                             events, adapters (given to it as parts)
    3  common/worker         device, tensors, the model runner
    2  common/core           sequence, blocks, scheduler: bookkeeping
    1  common/models         the forward passes: no engine
    0  common/layers, common/*.py   kernels, sampling; config, loader
    bench/                   measurement: may import common/

A module imports only from its own floor or the floors below, lazy
imports included; nothing under `common/` imports `bench/` (tests may);
no module of `common/` takes part in an import cycle.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.layout

ROOT = Path(__file__).resolve().parents[1]
ENGINE_LAYERS = ["common/engine", "common/metrics", "common/spec_decode", "common/lora",
                 "common/structured_output", "common/worker", "common/core",
                 "common/layers", "common/models"]
FLOORS = {"common.entrypoints": 6, "common.engine": 5, "common.spec_decode": 4,
          "common.structured_output": 4, "common.metrics": 4, "common.lora": 4,
          "common.worker": 3,
          "common.core": 2, "common.models": 1, "common.layers": 0}
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


def floor(module: str) -> int:
    """A module's floor: its package's (a module of common/ itself: 0)."""
    for package, level in FLOORS.items():
        if module == package or module.startswith(package + "."):
            return level
    return 0


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} (floor {floor(module)}) imports {target} (floor {floor(target)})"
                  for module, targets in graph.items() for target in targets
                  if floor(target) > floor(module))


def test_imports_only_go_down():
    assert upward_imports(import_graph()) == []


def test_the_floor_check_catches_an_upward_import():
    graph = {"common.core.scheduler": {"common.worker.model_runner"},
             "common.worker.model_runner": {"common.core.scheduler"}}
    assert upward_imports(graph) == [
        "common.core.scheduler (floor 2) imports common.worker.model_runner (floor 3)"]


def test_the_serving_layer_leaves_no_hook_for_a_chapter_to_fill():
    """The serving layer is composed, not flagged: no base-class hook left
    for a chapter to fill (`NotImplementedError`)."""
    folder = ROOT / "common/entrypoints"
    hooks = [p.name for p in folder.glob("*.py") if "NotImplementedError" in p.read_text()]
    assert hooks == []
