"""The package's structure: no import cycles among its modules (counting function-local
imports), and the pure modules import no client library, even indirectly."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "plugins" / "kafka2pg"
CLIENT_LIBRARIES = {"psycopg", "confluent_kafka", "pyspark", "py4j", "great_expectations", "airflow", "pandas"}
PURE = ("kafka2pg.lifecycle", "kafka2pg.planner")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(package modules, other top-level packages) that `path` imports anywhere in its body."""
    inner, outer = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] != "kafka2pg":
                outer.add(name.split(".")[0])
            elif name in modules:
                inner.add(name)
    return inner, outer


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = _modules()
    graph, outside = {}, {}
    for name, path in modules.items():
        inner, outer = _imports(path, modules)
        graph[name] = inner - {name, "kafka2pg"}  # the package __init__ imports nothing of its own
        outside[name] = outer
    return graph, outside


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycle():
    graph, _ = _graph()
    assert len(graph) > 30  # every module was read
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_function_local_cycle(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from kafka2pg.b import f\n")
    b.write_text("def g():\n    from kafka2pg.a import h\n")
    modules = {"kafka2pg.a": a, "kafka2pg.b": b}
    graph = {name: _imports(path, modules)[0] for name, path in modules.items()}
    assert cycles(graph) == [["kafka2pg.a", "kafka2pg.b"]]


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_import_no_client_library(module):
    graph, outside = _graph()
    reached, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(graph[name])
    assert {lib for name in reached for lib in outside[name]} & CLIENT_LIBRARIES == set()


PURE_TOO = ("kafka2pg.replay_request", "kafka2pg.exceptions", "kafka2pg.admission", "kafka2pg.task_log")


@pytest.mark.parametrize("module", PURE_TOO)
def test_request_parsing_and_errors_import_no_client_library(module):
    test_pure_modules_import_no_client_library(module)
