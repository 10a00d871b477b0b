"""What a reader of the user's input hands to :func:`p2ptrain.data.build_source`: the arrays,
and what their numbers mean (class names, pixels, token ids and the tokenizer that made them).

Also the two small things every reader needs: a dataset name from a file name, and the import of
an optional dependency that names the extra to install when it is missing.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from p2ptrain.base import UserError

# pip's name of each optional module, all in the `data` extra (pyproject.toml).
_PACKAGES = {"PIL": "Pillow", "pyarrow": "pyarrow", "tokenizers": "tokenizers"}


@dataclass(frozen=True)
class Source:
    """``features`` and ``labels`` have one row per sample. ``images``: features are uint8
    ``(N, channels, height, width)`` pixels. ``vocab_size``: features and labels are token ids,
    made by ``tokenizer`` (the bytes of a ``tokenizer.json``) or, without one, bytes."""

    name: str
    features: np.ndarray
    labels: np.ndarray
    classes: tuple[str, ...] | None = None
    images: bool = False
    vocab_size: int | None = None
    tokenizer: bytes | None = None


def need(module: str, what: str) -> ModuleType:
    """Import an optional dependency, or one line saying which extra brings it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = _PACKAGES.get(module.split(".")[0], module)
        raise UserError(f"{what} needs {package}: pip install 'p2ptrain[data]'") from None


def dataset_name(stem: str) -> str:
    """A manifest name (letters, digits, ``._-``, at most 64) made from a file or folder name."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-._")[:64].rstrip("-._")
    return name or "dataset"
