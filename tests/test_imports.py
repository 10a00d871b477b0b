"""Import rules that keep modules in their rooms: the CLI never imports the test helpers, and no
test or bench imports constants from a CLI command (they live where the CLI imports them too)."""

from __future__ import annotations

import ast
import subprocess
import sys
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
                 if any(m.startswith("p2ptrain.testing") for m in imported_modules(p))]
    assert offenders == []


def test_tests_take_the_demo_task_and_node_flags_from_their_own_modules():
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "p2ptrain.cli.demo":
                offenders.append((path.name, [alias.name for alias in node.names]))
    assert offenders == []


# -- The layering (docs/architecture.md draws it): which package may import which ----------------
# Data flows one way, transport -> messages -> protocol logic -> training; a package imports only
# those below it. Any package may import ``p2ptrain`` itself (its ``__version__``) and the private
# helper ``p2ptrain._exports`` (how each ``__init__`` loads its public names).
_TRANSPORT = {"base", "wire", "net", "control", "mesh", "ipfs"}
_LEARNING = {"base", "wire", "ipfs", "data", "collective", "models", "task", "protocol"}
MAY_IMPORT: dict[str, set[str]] = {
    "base": set(),
    "wire": {"base"},
    "net": {"base"},
    "control": {"base"},
    "mesh": {"base", "wire", "net"},
    "ipfs": {"base", "net"},
    "data": {"base", "ipfs"},
    "collective": {"base", "wire", "net"},
    "pipeline": {"base", "wire", "net", "models", "collective"},
    "models": {"base"},
    "task": {"base", "wire", "ipfs", "models"},
    "protocol": {"base", "wire", "task"},
    "training": _LEARNING,
    "node": _TRANSPORT,
    "run": _TRANSPORT | _LEARNING | {"node", "training", "collective", "net", "pipeline"},
    "services": _TRANSPORT | _LEARNING | {"node", "training", "run"},
    "serve": _TRANSPORT | _LEARNING | {"node", "training", "run", "services"},
    "testing": _TRANSPORT | _LEARNING | {"node", "training", "run", "services"},
    "api": _TRANSPORT | _LEARNING | {"node", "training", "run", "services"},
    "cli": _TRANSPORT | _LEARNING | {"node", "training", "run", "services", "serve", "api"},
}
# Imports that point up, each waiting for its helper to move down (remove the line when it has).
UPWARD_IMPORTS_TO_MOVE = [
]
PACKAGES = sorted(p.name for p in (ROOT / "p2ptrain").iterdir() if (p / "__init__.py").exists())


def package_imports(package: str) -> list[tuple[str, str]]:
    """(module file, imported p2ptrain module) of every import in ``package``, lazy ones too; a
    ``from p2ptrain.x import y`` counts as ``p2ptrain.x.y`` where y is a module."""
    found = []
    for path in sorted((ROOT / "p2ptrain" / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(path.name, alias.name) for alias in node.names if alias.name.startswith("p2ptrain")]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("p2ptrain"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    is_module = (ROOT / Path(*full.split("."))).with_suffix(".py").exists()
                    found.append((path.name, full if is_module else node.module))
    return found


def test_every_package_has_its_place_in_the_layering():
    assert sorted(MAY_IMPORT) == PACKAGES


def test_packages_import_only_the_layers_below_them():
    offenders = []
    for package in PACKAGES:
        for module, imported in package_imports(package):
            parts = imported.split(".")
            if len(parts) < 2 or parts[1] == "_exports":
                continue
            if parts[1] != package and parts[1] not in MAY_IMPORT[package]:
                offenders.append(f"p2ptrain/{package}/{module} imports {imported}")
    assert sorted(set(offenders) - set(UPWARD_IMPORTS_TO_MOVE)) == []


def test_no_package_imports_another_one_s_private_modules():
    offenders = [f"p2ptrain/{package}/{module} imports {imported}"
                 for package in PACKAGES for module, imported in package_imports(package)
                 if imported.count(".") >= 2 and imported.split(".")[1] != package
                 and imported.split(".")[2].startswith("_")]
    assert offenders == []


def test_no_two_modules_share_a_name():
    # cli/'s public modules are named after the command group each implements (cli/node.py: `p2ptrain
    # node`); its private helpers (cli/_home_options.py) follow the rule.
    stems: dict[str, list[str]] = {}
    for path in sorted((ROOT / "p2ptrain").rglob("*.py")):
        rel = path.relative_to(ROOT / "p2ptrain")
        if path.name != "__init__.py" and (rel.parts[0] != "cli" or path.name.startswith("_")):
            stems.setdefault(path.stem.lstrip("_"), []).append(str(rel))
    assert {stem: paths for stem, paths in stems.items() if len(paths) > 1} == {}


def test_the_package_root_holds_no_loose_modules():
    assert sorted(p.name for p in (ROOT / "p2ptrain").glob("*.py")) == ["__init__.py", "_exports.py"]


# A peer pays torch's warm-up (the import of torch._dynamo, 4 s of CPU here) at its first task run,
# not at start: most nodes a user starts to fetch, store or relay never train.
PEER_WITHOUT_TASK = """
import sys
from pathlib import Path
from p2ptrain.node import Node
from p2ptrain.services import TaskOptions, make_peer
make_peer(Node(Path(sys.argv[1])), TaskOptions(accept_tasks=True))
import torch
print('torch._dynamo' in sys.modules)
"""


def test_a_peer_warms_torch_up_at_its_first_run_not_at_start(tmp_path):
    out = subprocess.run([sys.executable, "-c", PEER_WITHOUT_TASK, str(tmp_path / "home")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]
