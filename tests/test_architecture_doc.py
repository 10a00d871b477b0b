"""docs/architecture.md stays a true map of the package: every folder of ``p2ptrain/`` has its line in
the layer diagram and its row in the modules table, every module file is named (as ``folder/name.py``,
in the first column) in its own folder's rows, and no row names a module that is gone.

The rule a new module follows: add a row (or its path to a row of related modules) under its folder's
row. Which package may import which is tests/test_imports.py's rule; here a folder row that lists what
its package imports ("Imports only `base`.") must list what the package's modules do import."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from tests.test_imports import package_imports

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "p2ptrain"
DOC = ROOT / "docs" / "architecture.md"

FOLDERS = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
MODULES = sorted(f"{p.parent.name}/{p.name}" for p in PACKAGE.glob("*/*.py") if p.name != "__init__.py")
IMPORTS_CLAIM = re.compile(r"\b[Ii]mports\b[^.|;]*")
PATH = re.compile(r"`([a-z_]+)/([A-Za-z_0-9]+\.py)?`?")


def diagram_folders(text: str) -> set[str]:
    """The folders the layer diagram (the first fenced block) draws: each line's first words,
    ``ipfs / data`` naming two."""
    block = text.split("```", 2)[1]
    names: set[str] = set()
    for line in block.splitlines():
        head = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        names.update(part.strip() for part in head.split(" / ") if part.strip())
    return names


def folder_rows(text: str) -> dict[str, str]:
    """Each folder's own row of the modules table (its second cell), by folder."""
    rows = re.findall(r"^\| `([a-z_]+)/` \| (.*) \|$", text, re.MULTILINE)
    return dict(rows)


def claimed_imports(row: str) -> set[str] | None:
    """The packages a folder row says its package imports, where it says so as a list ("Imports only
    `base`.", "it imports `base`, `wire` (CIDs) and `models`"); None where it says something else
    ("Imports `services` and everything below it")."""
    for claim in IMPORTS_CLAIM.findall(re.sub(r"\([^()]*\)", "", row)):
        names = re.findall(r"`([a-z_]+)`", claim)
        if names and re.fullmatch(r"[Ii]mports( only)?[\s,]*(``[\s,]*(and\s+)?)*", re.sub(r"`[a-z_]+`", "``", claim).strip()):
            return set(names)
    return None


@functools.cache
def actual_imports(package: str) -> set[str]:
    """The other packages of ours that ``package``'s modules import (lazily too)."""
    used = {imported.split(".")[1] for _, imported in package_imports(package) if imported.count(".") >= 1}
    return used - {package, "_exports"}


def table_sections(text: str) -> dict[str, list[str]]:
    """The modules table's first cells, by folder: a cell that is exactly ``folder/`` opens that
    folder's section, and the rows below it up to the next such cell are its rows."""
    table = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    sections: dict[str, list[str]] = {}
    current = None
    for line in table.splitlines():
        if not line.startswith("| ") or line.startswith("| module |"):
            continue
        cell = line.split(" | ", 1)[0].removeprefix("| ").strip()
        folder = re.fullmatch(r"`([a-z_]+)/`", cell)
        if folder:
            current = folder.group(1)
            assert current not in sections, f"two rows for the folder {current}/"
            sections[current] = []
        elif current is not None:
            sections[current].append(cell)
    return sections


def named_modules(cells: list[str]) -> set[str]:
    return {f"{m.group(1)}/{m.group(2)}" for cell in cells for m in PATH.finditer(cell) if m.group(2)}


def test_the_diagram_draws_every_folder():
    drawn = diagram_folders(DOC.read_text())
    assert ([f for f in FOLDERS if f not in drawn], sorted(drawn - set(FOLDERS))) == ([], [])


def test_every_folder_has_its_row():
    sections = table_sections(DOC.read_text())
    assert ([f for f in FOLDERS if f not in sections], [f for f in sections if f not in FOLDERS]) == ([], [])


def test_every_module_is_named_in_its_folder_s_rows():
    sections = table_sections(DOC.read_text())
    missing = [module for module in MODULES
               if module not in named_modules(sections.get(module.split("/")[0], []))]
    assert missing == [], "add a row for each (or its path to a row) under its folder's row in docs/architecture.md"


def test_every_module_the_doc_names_exists():
    text = DOC.read_text()
    named = {f"{m.group(1)}/{m.group(2)}" for m in PATH.finditer(text) if m.group(1) in FOLDERS and m.group(2)}
    assert sorted(module for module in named if not (PACKAGE / module).is_file()) == []


def test_what_a_folder_row_says_its_package_imports_is_what_it_imports():
    claims = {folder: claimed_imports(row) for folder, row in folder_rows(DOC.read_text()).items()}
    assert len([c for c in claims.values() if c is not None]) >= 10  # the parser still finds the claims
    wrong = {folder: f"says {sorted(claimed)}, imports {sorted(actual_imports(folder))}"
             for folder, claimed in claims.items() if claimed is not None and claimed != actual_imports(folder)}
    assert wrong == {}
