"""The product never imports the dev tooling (kafka2pg.devtools): only the CLI's dev commands do,
inside their functions, so an installed pipeline loads none of it (CONVENTIONS.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "plugins" / "kafka2pg"
DEV_COMMANDS = {"cmd_stack", "_reset_stack", "cmd_produce", "cmd_demo"}


def _devtools_imports(tree: ast.AST) -> list[tuple[str, int]]:
    """(enclosing top-level function or "<module>", line) of each import of kafka2pg.devtools."""
    found = []
    for top in tree.body:
        owner = top.name if isinstance(top, ast.FunctionDef) else "<module>"
        for node in ast.walk(top):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(name.startswith("kafka2pg.devtools") for name in names):
                found.append((owner, node.lineno))
    return found


def test_only_the_cli_dev_commands_import_devtools():
    product = [p for p in PACKAGE.rglob("*.py") if "devtools" not in p.relative_to(PACKAGE).parts]
    assert len(product) > 20, "the package's modules were not found"
    offending = []
    for path in product:
        for owner, line in _devtools_imports(ast.parse(path.read_text())):
            if not (path.name == "cli.py" and owner in DEV_COMMANDS):
                offending.append(f"{path.relative_to(PACKAGE)}:{line} ({owner})")
    assert not offending, f"product code importing kafka2pg.devtools: {offending}"
