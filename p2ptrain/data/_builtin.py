"""Where datasets come from before they become shards: scikit-learn's bundled real data, text that
ships with Python, or a folder of arrays (image folders, tables and text files:
:mod:`p2ptrain.data._read_source`).

``sklearn:<name>`` reads a data set scikit-learn ships inside its wheel (nothing is downloaded).
``text:python-stdlib`` is a language-modelling set from the Python standard library's own sources
(on every machine that runs p2ptrain): the ``.py`` files in path order, as bytes (the tokens; a
vocabulary of 256), cut into windows of :data:`TEXT_CONTEXT` + 1 bytes; features are a window's
first TEXT_CONTEXT bytes, labels its last TEXT_CONTEXT (the next byte at every position), both
uint8, for ``transformer_lm`` with ``vocab_size = 256``. A folder
holds either ``features.npy`` + ``labels.npy``, or ``.npz`` files with those two arrays, or ``.csv``
files of numbers whose last column is the label; several files are concatenated in name order. numpy
files are read with ``allow_pickle=False``: a folder may have come from anywhere.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from p2ptrain.data._source import dataset_name
from p2ptrain.base import UserError

SKLEARN = ("digits", "iris", "wine", "breast_cancer")
TEXT = ("python-stdlib",)
# Tokens per sample of a text source: the context of node/tasks/stdlib-lm.toml's transformer_lm.
TEXT_CONTEXT = 128
# The text read, at most: 8 MiB is ~65,000 windows of 129 bytes (16.5 MiB of shards with their
# labels), many epochs of a benchmark's run, and a bound on what `dataset add` holds in memory.
TEXT_MAX_BYTES = 8 * 1024 * 1024
# Folders of the standard library's tree that hold what was installed beside it, not the library.
INSTALLED_FOLDERS = frozenset({"site-packages", "dist-packages"})


def load_source(source: str) -> tuple[str, np.ndarray, np.ndarray]:
    """Return ``(name, features, labels)``; features float32 and labels int64 for built-in sets."""
    if source.startswith("sklearn:"):
        return _sklearn(source.removeprefix("sklearn:"))
    if source.startswith("text:"):
        return _text(source.removeprefix("text:"))
    path = Path(source)
    if path.is_dir():
        features, labels = load_folder(path)
        return dataset_name(path.resolve().name), features, labels
    known = [f"sklearn:{n}" for n in SKLEARN] + [f"text:{n}" for n in TEXT]
    raise UserError(f"{source}: not a folder, and not one of " + ", ".join(known))


def _sklearn(name: str) -> tuple[str, np.ndarray, np.ndarray]:
    if name not in SKLEARN:
        raise UserError(f"unknown built-in data set sklearn:{name} (have: {', '.join(SKLEARN)})")
    import sklearn.datasets

    bunch = getattr(sklearn.datasets, f"load_{name}")()
    return name.replace("_", "-"), bunch.data.astype(np.float32), bunch.target.astype(np.int64)


def _text(name: str) -> tuple[str, np.ndarray, np.ndarray]:
    from p2ptrain.data._tokens import token_source

    source = token_source(f"text-{name}", stdlib_documents(name), TEXT_CONTEXT)
    return source.name, source.features, source.labels


def stdlib_documents(name: str = "python-stdlib") -> list[tuple[str, bytes]]:
    """``(path, bytes)`` of the standard library's ``.py`` files in path order, up to
    :data:`TEXT_MAX_BYTES` in all (the last one cut there)."""
    if name not in TEXT:
        have = ", ".join(f"text:{n}" for n in TEXT)
        raise UserError(f"unknown built-in text text:{name} (have: {have})")
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for folder, subfolders, files in os.walk(root):
        # What was installed, not what ships with Python: not even walked (a venv's or a system's
        # packages, 13,000 files here for the standard library's 700: 0.4 CPU-s a call, now 0.04).
        subfolders[:] = [d for d in subfolders if d not in INSTALLED_FOLDERS]
        found.extend(Path(folder, name) for name in files if name.endswith(".py"))
    documents: list[tuple[str, bytes]] = []
    total = 0
    for path in sorted(found):
        if any(part in INSTALLED_FOLDERS for part in path.parts):
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        documents.append((str(path), data[: TEXT_MAX_BYTES - total]))
        total += len(documents[-1][1])
        if total >= TEXT_MAX_BYTES:
            break
    return documents


def load_folder(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """Read a folder in one of the three layouts described in the module docstring."""
    if (folder / "features.npy").exists():
        return _pair(_npy(folder / "features.npy"), _npy(folder / "labels.npy"), folder)
    npz = sorted(folder.glob("*.npz"))
    csv = sorted(folder.glob("*.csv"))
    if npz and csv:
        raise UserError(f"{folder}: holds both .npz and .csv files; use one kind")
    parts = []
    for path in npz:
        with _npy(path) as archive:
            if not {"features", "labels"} <= set(archive.files):
                raise UserError(f"{path}: needs arrays 'features' and 'labels', has {archive.files}")
            parts.append(_pair(_array(archive, "features", path), _array(archive, "labels", path), path))
    for path in csv:
        table = _read_csv(path)
        parts.append(_pair(table[:, :-1], table[:, -1].astype(np.int64), path))
    if not parts:
        raise UserError(f"{folder}: no features.npy/labels.npy, .npz or .csv files")
    try:
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    except ValueError as exc:
        raise UserError(f"{folder}: files do not have matching shapes: {exc}") from None


def _npy(path: Path) -> Any:
    """``np.load`` without pickle; a missing or unreadable file is the user's to fix."""
    try:
        return np.load(path, allow_pickle=False)  # an array, or an archive of them (.npz)
    except FileNotFoundError:
        raise UserError(f"{path}: missing") from None
    except (ValueError, OSError) as exc:
        raise UserError(f"{path}: cannot read as a numpy file without pickle: {exc}") from None


def _array(archive: Any, key: str, path: Path) -> np.ndarray:
    try:
        array: np.ndarray = archive[key]
        return array
    except ValueError as exc:  # object arrays refuse to load without pickle
        raise UserError(f"{path}[{key}]: {exc}") from None


def _read_csv(path: Path) -> np.ndarray:
    """A numeric CSV, with or without one header line."""
    with open(path, errors="replace") as f:  # a binary file is refused by loadtxt below, in one line
        first = f.readline()
    skip = 0 if all(_is_number(v) for v in first.strip().split(",")) else 1
    try:
        table = np.loadtxt(path, delimiter=",", skiprows=skip, dtype=np.float32, ndmin=2)
    except ValueError as exc:
        raise UserError(f"{path}: not a numeric CSV: {exc}") from None
    if table.shape[1] < 2:
        raise UserError(f"{path}: needs at least one feature column and a label column")
    return table


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _pair(features: np.ndarray, labels: np.ndarray, where: Path) -> tuple[np.ndarray, np.ndarray]:
    if features.ndim < 1 or labels.ndim < 1 or len(features) != len(labels) or len(features) == 0:
        raise UserError(f"{where}: features and labels need the same number (>0) of samples "
                        f"(have {features.shape} and {labels.shape})")
    return features, labels
