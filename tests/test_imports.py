"""Import rules that keep modules in their rooms: the CLI never imports the test helpers, and no
test or bench imports constants from a CLI command (they live where the CLI imports them too)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at top level or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_cli_does_not_import_testing():
    offenders = [p.name for p in sorted((ROOT / "p2ptrain" / "cli").glob("*.py"))
                 if "p2ptrain.testing" in imported_modules(p)]
    assert offenders == []


def test_tests_take_the_demo_task_and_node_flags_from_their_own_modules():
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "p2ptrain.cli.demo":
                offenders.append((path.name, [alias.name for alias in node.names]))
    assert offenders == []
