"""The folders draw the architecture; this test keeps the arrows pointing
one way.

    common/engine, common/layers, common/models   the engine: no web server,
                                                   no entrypoint, no bench
    common/entrypoints                             servers and the offline LLM
    bench/                                         measurement: may import common/

Nothing under `common/` imports `bench/` (tests may).
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
