"""``dataset add SOURCE``: which reader a SOURCE goes to, with which options.

- ``sklearn:NAME``, ``text:python-stdlib`` and folders of arrays: :mod:`p2ptrain.data._builtin`;
- a folder of class folders of PNG/JPEG files: :mod:`p2ptrain.data._images` (``image_size``);
- a ``.parquet``, ``.arrow``/``.feather`` or ``.jsonl`` file: :mod:`p2ptrain.data._tables`
  (``features`` + ``label``, or ``text``);
- ``text:PATH`` (a file, a folder, or a glob of text files) and ``text:python-stdlib`` with a
  tokenizer or another context: :mod:`p2ptrain.data._tokens` (``tokenizer``, ``context``, ``eos``;
  also for a table's ``text`` column).

An option that the SOURCE's reader does not use is refused, in one line, rather than ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from p2ptrain.data import _builtin as builtin
from p2ptrain.data._images import is_image_folder, read_image_folder
from p2ptrain.data._source import Source, dataset_name
from p2ptrain.data._tables import table_arrays, table_documents, table_kind
from p2ptrain.data._tokens import read_documents, read_tokenizer, text_files, token_source
from p2ptrain.base import ArgumentError, UserError

Progress = Callable[[int], None]


@dataclass(frozen=True)
class SourceOptions:
    """How to read a SOURCE (each is a ``dataset add`` flag of the same name)."""

    image_size: tuple[int, int] | None = None
    features: tuple[str, ...] | None = None
    label: str | None = None
    text: str | None = None
    tokenizer: Path | None = None
    context: int = builtin.TEXT_CONTEXT
    eos: str | None = None


TEXT_OPTIONS = {"tokenizer", "context", "eos"}


def read_source(spec: str, options: SourceOptions = SourceOptions(), progress: Progress | None = None) -> Source:
    """Read SOURCE ``spec`` into arrays (nothing is stored)."""
    if spec.startswith("text:"):
        _only(options, TEXT_OPTIONS, "text")
        return _text(spec.removeprefix("text:"), options, progress)
    if spec.startswith("sklearn:"):
        _only(options, set(), spec)
        return Source(*builtin.load_source(spec))
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"{spec}: no such file or folder (check the path; sklearn: and text: sources take the prefix)")
    kind = table_kind(path)
    if kind is not None:
        return _table(path, options, progress)
    if path.is_dir() and is_image_folder(path):
        _only(options, {"image_size"}, "an image folder")
        return read_image_folder(path, options.image_size, progress)
    if path.is_dir():
        _only(options, set(), "a folder of arrays")
        return Source(*builtin.load_source(spec))
    known = [f"sklearn:{n}" for n in builtin.SKLEARN] + [f"text:{n}" for n in builtin.TEXT]
    raise UserError(f"{spec}: not a folder, a .parquet/.arrow/.feather/.jsonl file, text:PATH, or one of "
                    + ", ".join(known))


def _text(spec: str, options: SourceOptions, progress: Progress | None) -> Source:
    tokenizer = read_tokenizer(options.tokenizer) if options.tokenizer is not None else None
    if spec in builtin.TEXT:
        if tokenizer is None and options.context == builtin.TEXT_CONTEXT:
            # As it always was: no `tokens` field, so its manifest keeps its CID.
            return Source(*builtin.load_source(f"text:{spec}"))
        name, documents = f"text-{spec}", iter(builtin.stdlib_documents(spec))
    else:
        files = text_files(spec)
        stem = Path(spec).name if Path(spec).exists() else Path(spec).parent.name
        name, documents = "text-" + dataset_name(stem), read_documents(files)
    return token_source(name, documents, options.context, tokenizer, options.eos, progress)


def _table(path: Path, options: SourceOptions, progress: Progress | None) -> Source:
    name = dataset_name(path.stem)
    if options.text is not None:
        _only(options, {"text"} | TEXT_OPTIONS, "a table's text column")
        tokenizer = read_tokenizer(options.tokenizer) if options.tokenizer is not None else None
        return token_source(name, table_documents(path, options.text), options.context, tokenizer, options.eos,
                            progress)
    if options.label is None:
        raise ArgumentError("{path}: a table needs {label:COL} (with {features:COL,...} or every other numeric "
                            "column), or {text:COL}", path=path)
    _only(options, {"features", "label"}, "a table")
    features, labels, classes = table_arrays(path, list(options.features) if options.features else None,
                                             options.label)
    return Source(name, features, labels, classes)


def _only(options: SourceOptions, allowed: set[str], what: str) -> None:
    default = SourceOptions()
    for field in fields(options):
        if field.name not in allowed and getattr(options, field.name) != getattr(default, field.name):
            raise ArgumentError("{" + field.name + "} does not apply to {what}", what=what)
