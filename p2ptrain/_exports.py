"""A package's public names, loaded on first use.

Each package keeps its code in private modules (``_name.py``) and lists its public names once, as
the ``X as X`` imports of an ``if TYPE_CHECKING:`` block in its ``__init__.py``: mypy and readers see
those imports; at run time :func:`lazy_exports` reads the same block and imports a name's module
only when the name is first asked for. The command line stays quick that way: ``p2ptrain --help``
imports no torch and no libp2p, though ``p2ptrain.ipfs`` exports the Bitswap exchange beside the CID
parser. A name whose module is the package itself (``from p2ptrain.base import boundedjson as
boundedjson``) is a public submodule.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def declared_exports(init_file: str | Path) -> dict[str, tuple[str, str]]:
    """{public name: (the module it comes from, its name there)} of a package, read from the ``if TYPE_CHECKING:`` block
    of its ``__init__.py``."""
    tree = ast.parse(Path(init_file).read_text(), str(init_file))
    names: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0:
                    for alias in stmt.names:
                        names[alias.asname or alias.name] = (stmt.module, alias.name)
    return names


def lazy_exports(package: str, init_file: str) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``__getattr__``, ``__dir__`` and ``__all__`` for ``package``, whose ``__init__.py`` is
    ``init_file``: a public name is imported from its module on first access, then kept."""
    exports = declared_exports(init_file)

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, original = exports[name]
        if module == package:
            value: Any = importlib.import_module(f"{package}.{original}")
        else:
            value = getattr(importlib.import_module(module), original)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__, sorted(exports)
