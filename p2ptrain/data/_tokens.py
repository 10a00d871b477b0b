"""Text as a language-modelling dataset: documents tokenized (a ``tokenizer.json`` of the
``tokenizers`` library, or bytes) and packed into fixed-length windows of token ids.

Every window is ``context + 1`` consecutive tokens of the concatenated documents (documents in
order, ``--eos`` between them when given); features are its first ``context`` tokens, labels its
last ``context`` (the next token at every position), as ``text:python-stdlib`` has always been.
Ids are stored in the smallest dtype that holds the vocabulary (uint8, uint16, int32) and the
manifest records the vocabulary size and the tokenizer's CID, so any peer decodes (or tokenizes a
prompt) with the same file: :func:`tokenizer_by_cid`.

A tokenizer file is JSON that arrives from the user (``dataset add``) or from the network (by CID):
it is bounded before the library parses it (size, nesting depth, vocabulary). Special tokens are
not added per document (a post-processor would wrap every piece of a long document); give
``--eos`` to separate documents. A long document is tokenized in pieces that end at a line end,
so memory stays bounded; a piece boundary is a pre-tokenizer boundary for the usual tokenizers.
"""

from __future__ import annotations

import glob
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from p2ptrain.base import ArgumentError, UserError, boundedjson
from p2ptrain.data._manifest import MAX_SAMPLE_ELEMENTS, MAX_VOCAB, TOKEN_DTYPES
from p2ptrain.data._source import Source, need
from p2ptrain.ipfs import ContentStore, FileTooLarge

# A tokenizer.json: Llama 3's is 9 MB, Gemma's (256k tokens) 34 MB.
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024
# A tokenizer.json nests normalizers and pre-tokenizers in sequences: real ones reach ~8 levels.
MAX_TOKENIZER_DEPTH = 32
# Text read for one dataset (and so the tokens held in memory): a few hundred million tokens.
MAX_TEXT_BYTES = 1 << 30
MAX_TEXT_FILES = 1 << 20
# Characters per piece handed to the tokenizer (a long document is cut at a line end).
PIECE_CHARS = 1 << 20
# Characters tokenized per call (the library runs a batch's pieces on all cores).
BATCH_CHARS = 8 << 20


class TokenizerError(UserError, ValueError):
    """A tokenizer file that is over the bounds or not one the ``tokenizers`` library reads."""


def parse_tokenizer(data: bytes, what: str = "tokenizer") -> Any:
    """A ``tokenizers.Tokenizer`` from the bytes of a ``tokenizer.json``, within the bounds."""
    if len(data) > MAX_TOKENIZER_BYTES:
        raise TokenizerError(f"{what}: {len(data)} B is over the {MAX_TOKENIZER_BYTES} B limit")
    try:
        raw = boundedjson.loads(data, max_depth=MAX_TOKENIZER_DEPTH, what=what)
    except boundedjson.JSONBoundsError as exc:
        raise TokenizerError(str(exc)) from None
    if type(raw) is not dict or type(raw.get("model")) is not dict:
        raise TokenizerError(f"{what}: not a tokenizer.json (an object with a 'model')")
    library = need("tokenizers", "a tokenizer file")
    with library_errors(f"{what}: the tokenizers library refuses it"):
        tokenizer = library.Tokenizer.from_str(data.decode())
        vocab = vocab_size(tokenizer)
    if not 2 <= vocab <= MAX_VOCAB:
        raise TokenizerError(f"{what}: a vocabulary of {vocab} ids, outside 2 to {MAX_VOCAB}")
    return tokenizer


@contextmanager
def library_errors(what: str) -> Iterator[None]:
    """The tokenizers library's failures as one :class:`TokenizerError`: it raises plain
    ``Exception`` for a bad file, and a Rust panic inside it arrives as ``PanicException``, which
    derives from ``BaseException`` (a fuzzed tokenizer.json panicked on a slice index)."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except TokenizerError:
        raise
    except BaseException as exc:  # (see the docstring)
        raise TokenizerError(f"{what}: {type(exc).__name__}: {str(exc)[:300]}") from None


def vocab_size(tokenizer: Any) -> int:
    """One more than the largest id (ids need not be dense), added tokens included."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def read_tokenizer(path: Path) -> bytes:
    """The bytes of a local tokenizer file, checked (the size before anything is read)."""
    try:
        size = path.stat().st_size
        if size > MAX_TOKENIZER_BYTES:
            raise TokenizerError(f"{path}: {size} B is over the {MAX_TOKENIZER_BYTES} B limit of a tokenizer file")
        with open(path, "rb") as f:
            data = f.read(MAX_TOKENIZER_BYTES + 1)  # bounded even if the file grew since stat()
    except OSError as exc:
        raise TokenizerError(f"{path}: {exc.strerror or exc}") from None
    parse_tokenizer(data, str(path))
    return data


def tokenizer_by_cid(store: ContentStore, cid: str) -> Any:
    """The tokenizer a manifest names (``manifest.tokens.tokenizer``), read (verified) from the
    store or the network, bounded like a local file."""
    try:
        data = store.cat(cid, max_bytes=MAX_TOKENIZER_BYTES)
    except FileTooLarge:
        raise TokenizerError(f"tokenizer {cid} is over the {MAX_TOKENIZER_BYTES} B limit") from None
    return parse_tokenizer(data, f"tokenizer {cid}")


def text_files(spec: str) -> list[Path]:
    """The files of ``text:SPEC``: one file, every file under a folder (hidden ones skipped), or a
    glob (``**`` recurses); in sorted order, at most :data:`MAX_TEXT_FILES` and :data:`MAX_TEXT_BYTES`."""
    path = Path(spec).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
    else:
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    if not files:
        raise UserError(f"text:{spec}: no such file, folder, or files matching it")
    if len(files) > MAX_TEXT_FILES:
        raise UserError(f"text:{spec}: {len(files)} files, over the limit of {MAX_TEXT_FILES}")
    total = sum(p.stat().st_size for p in files)
    if total > MAX_TEXT_BYTES:
        raise UserError(f"text:{spec}: {total} B of text, over the {MAX_TEXT_BYTES} B limit of one dataset")
    return files


def read_documents(files: Iterable[Path]) -> Iterator[tuple[str, bytes]]:
    """``(path, bytes)`` of each file (bounded: a file that grew past the limit since it was listed
    is refused)."""
    total = 0
    for path in files:
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_TEXT_BYTES - total + 1)
        except OSError as exc:
            raise UserError(f"{path}: {exc.strerror or exc}") from None
        total += len(data)
        if total > MAX_TEXT_BYTES:
            raise UserError(f"{path}: the text is over the {MAX_TEXT_BYTES} B limit of one dataset")
        yield str(path), data


def token_source(
    name: str,
    documents: Iterable[tuple[str, bytes | str]],
    context: int,
    tokenizer: bytes | None = None,
    eos: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> Source:
    """Documents (``(where, text)``: ``where`` names it in errors) as windows of ``context + 1``
    token ids (see the module docstring); ``tokenizer`` is a checked ``tokenizer.json``
    (:func:`read_tokenizer`), ``None`` for bytes."""
    if not 1 <= context < MAX_SAMPLE_ELEMENTS:
        raise ArgumentError("{context:{value}}: give 1 to {most} tokens", value=context, most=MAX_SAMPLE_ELEMENTS - 1)
    if tokenizer is None:
        if eos is not None:
            raise ArgumentError("{eos} needs a {tokenizer} (bytes have no end-of-document token)")
        parts = [np.frombuffer(d.encode() if isinstance(d, str) else d, dtype=np.uint8) for _, d in documents]
        ids, vocab = np.concatenate(parts) if parts else np.zeros(0, np.uint8), 256
    else:
        model = parse_tokenizer(tokenizer)
        vocab = vocab_size(model)
        ids = _tokenize(model, documents, _eos_id(model, eos), _dtype(vocab), progress)
    window = context + 1
    count = len(ids) // window
    if count < 2:
        raise ArgumentError("{name}: {count} tokens make fewer than 2 windows of {window}: add text or lower {context}",
                            name=name, count=len(ids), window=window)
    windows = ids[: count * window].reshape(count, window)
    return Source(name, np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:]),
                  vocab_size=vocab, tokenizer=tokenizer)


def _dtype(vocab: int) -> np.dtype:
    return np.dtype(next(name for name, size in TOKEN_DTYPES.items() if vocab <= size))


def _eos_id(model: Any, eos: str | None) -> int | None:
    if eos is None:
        return None
    token = model.token_to_id(eos)
    if token is None:
        raise ArgumentError("{eos:{value!r}} is not a token of the tokenizer", value=eos)
    return int(token)


def _tokenize(model: Any, documents: Iterable[tuple[str, bytes | str]], eos: int | None, dtype: np.dtype,
              progress: Callable[[int], None] | None) -> np.ndarray:
    parts: list[np.ndarray] = []
    pending: list[str | None] = []  # pieces of text, and None where an eos goes
    chars = 0
    end = np.asarray([eos if eos is not None else 0], dtype=dtype)

    def flush() -> None:
        with library_errors("the tokenizer fails on this text"):
            encoded = iter(model.encode_batch([p for p in pending if p is not None], add_special_tokens=False))
        parts.extend(end if p is None else np.asarray(next(encoded).ids, dtype=dtype) for p in pending)
        pending.clear()

    for where, document in documents:
        text = document if isinstance(document, str) else _utf8(document, where)
        for piece in _pieces(text):
            pending.append(piece)
            chars += len(piece)
            if chars >= BATCH_CHARS:
                flush()
                chars = 0
        if eos is not None:
            pending.append(None)
        if progress is not None:
            progress(1)
    flush()
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def _utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{where}: not UTF-8 text (byte {exc.start}), and a tokenizer reads text") from None


def _pieces(text: str) -> Iterator[str]:
    """``text`` cut after a line end near every :data:`PIECE_CHARS` characters."""
    start = 0
    while len(text) - start > PIECE_CHARS:
        cut = text.rfind("\n", start, start + PIECE_CHARS)
        end = cut + 1 if cut > start else start + PIECE_CHARS
        yield text[start:end]
        start = end
    if start < len(text):
        yield text[start:]
