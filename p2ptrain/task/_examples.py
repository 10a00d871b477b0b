"""The example task files (``digits-mlp``, ``stdlib-lm``, ``llama-pipeline``), shipped in the package.

Why in the package: whoever installed p2ptrain from a wheel has no checkout, so no ``node/tasks/``
to copy a task from; ``p2ptrain task example NAME`` writes one out of the installed package. There
is one copy of each: the checkout's ``node/tasks/NAME.toml`` are links to ``p2ptrain/task/examples``.
They are read with :mod:`importlib.resources`, so they are found wherever the package is installed
(a wheel, an editable install, a zip).
"""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable

from p2ptrain.base import UserError

_SUFFIX = ".toml"


def _folder() -> Traversable:
    return resources.files("p2ptrain.task").joinpath("examples")


def example_names() -> list[str]:
    """The names of the example task files, sorted (``digits-mlp``, ...)."""
    return sorted(entry.name[: -len(_SUFFIX)] for entry in _folder().iterdir()
                  if entry.is_file() and entry.name.endswith(_SUFFIX))


def example_task(name: str) -> str:
    """The text of example task ``name``; a :class:`UserError` listing the names for an unknown one."""
    names = example_names()
    if name not in names:
        raise UserError(f"no example task {name!r}: the examples are {', '.join(names)}")
    return _folder().joinpath(name + _SUFFIX).read_text(encoding="utf-8")
