"""Blocks on disk, keyed by multihash, verified on the way in and on the way out; plus the pin set.

Layout (under ``root``, normally ``<home>/blocks``), modelled on Kubo's flatfs so it is easy to inspect:
``<root>/<XX>/<BASE32-MULTIHASH>.data`` where ``XX`` is the next-to-last two characters of the key.
Keying by multihash (not by CID) means CIDv0 and CIDv1 names of the same dag-pb block share one file,
as in Kubo. Each block is written to a temporary file, fsynced, and renamed into place, so a crash
never leaves a half-written block under a real name, and concurrent writers (DataLoader workers,
several processes) of the same block cannot interleave.

Disks rot and people edit files: a block whose bytes no longer match its hash is moved to
``<root>/quarantine/`` and reported as :class:`CorruptBlock`, so the caller can fetch it again.
Pins live in ``<root>/pins.json``, rewritten atomically under an exclusive lock.
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import hashlib
import json
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from p2ptrain.base import boundedjson, write_atomic
from p2ptrain.ipfs._cid import CID, RAW, BlockMismatch, InvalidCID, cid_str, parse_cid, verify_block
from p2ptrain.ipfs._dagpb import MAX_BLOCK_SIZE

PINS_FILE = "pins.json"
PINS_VERSION = 1
RECURSIVE = "recursive"
DIRECT = "direct"
WRITERS = 8
# pins.json is ours, but a person may edit it and a disk may rot it. 64 MiB holds ~600,000 pins of
# ~100 bytes each; a bigger file is refused before it is read into memory.
MAX_PINS_FILE_BYTES = 64 * 1024 * 1024
# File times come from a coarse kernel clock (a jiffy behind time.time() on Linux, 2 s steps on FAT):
# a sweep keeps every block written less than this before the collection began, so a block stored
# just as it began is never taken for an old one.
MTIME_SLACK_S = 2.0


class BlockNotFound(KeyError):
    """The store does not hold the block."""

    def __init__(self, cid: CID) -> None:
        super().__init__(cid_str(cid))
        self.cid = cid

    def __str__(self) -> str:
        return f"block {cid_str(self.cid)} is not in the local store"


class CorruptBlock(BlockMismatch):
    """A stored block no longer matches its hash; it has been quarantined."""


class PinFileError(ValueError):
    """``pins.json`` exists but cannot be understood; nothing is rewritten until a person looks."""


def _key(cid: CID) -> str:
    return base64.b32encode(bytes(cid.digest)).decode("ascii").rstrip("=")


_SHA2_256_PREFIX = b"\x12\x20"


def _multihash_of(path: Path) -> bytes | None:
    """The multihash a block file's name says it holds, or None for a name that is not one."""
    key = path.name[: -len(".data")]
    try:
        digest = base64.b32decode(key + "=" * (-len(key) % 8))
    except (binascii.Error, ValueError):
        return None
    if len(digest) != 34 or not digest.startswith(_SHA2_256_PREFIX) or _key_of(digest) != key:
        return None
    return digest


def _key_of(multihash: bytes) -> str:
    return base64.b32encode(multihash).decode("ascii").rstrip("=")


@dataclass
class BadBlock:
    """A block file that does not hold what its name says (``repo verify``)."""

    path: Path
    cid: str | None  # the CIDv1 raw name of the multihash in its file name; None if the name is not one
    reason: str


@dataclass
class Sweep:
    """What a garbage collection removed (or, dry, would remove) and kept."""

    removed: int = 0
    removed_bytes: int = 0
    kept: int = 0
    kept_bytes: int = 0
    removed_cids: list[str] = field(default_factory=list)


class BlockStore:
    """Content-addressed blocks under one directory. Synchronous; call from trio via ``to_thread``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, cid: CID) -> Path:
        key = _key(cid)
        return self.root / key[-3:-1] / f"{key}.data"

    def has(self, cid: CID | str) -> bool:
        return self._path(parse_cid(cid)).exists()

    def get(self, cid: CID | str) -> bytes:
        """The block's bytes, verified; :class:`BlockNotFound` or :class:`CorruptBlock` otherwise."""
        cid = parse_cid(cid)
        path = self._path(cid)
        try:
            with open(path, "rb") as f:
                # Sized from fstat: read(MAX_BLOCK_SIZE + 1) would map and zero 2 MiB per block.
                data = f.read(min(os.fstat(f.fileno()).st_size, MAX_BLOCK_SIZE) + 1)
        except FileNotFoundError:
            raise BlockNotFound(cid) from None
        try:
            if len(data) > MAX_BLOCK_SIZE:
                raise BlockMismatch(cid, "too large")
            verify_block(cid, data)
        except BlockMismatch:
            self._quarantine(path)
            raise CorruptBlock(
                cid, f"stored copy {path} does not match the CID's hash; quarantined, fetch it again"
            ) from None
        return data

    def _quarantine(self, path: Path) -> None:
        quarantine = self.root / "quarantine"
        quarantine.mkdir(exist_ok=True)
        try:
            os.replace(path, quarantine / path.name)
        except FileNotFoundError:  # another reader got there first
            pass

    def put(self, cid: CID | str, data: bytes, *, hashed: bool = False) -> None:
        """Store ``data`` as ``cid`` after checking its hash (:class:`BlockMismatch` if wrong).

        ``hashed``: this process has just computed ``cid`` from these very bytes (the importer
        does), so the check is skipped; hashing a checkpoint twice was a third of its store time.
        """
        cid = parse_cid(cid)
        if len(data) > MAX_BLOCK_SIZE:
            raise BlockMismatch(cid, f"block of {len(data)} bytes exceeds {MAX_BLOCK_SIZE}")
        if not hashed:
            verify_block(cid, data)
        path = self._path(cid)
        try:
            os.utime(path)  # held already: "written now" as far as a concurrent gc's sweep is concerned
            return
        except FileNotFoundError:
            pass
        path.parent.mkdir(exist_ok=True)
        write_atomic(path, data)

    def put_many(self, blocks: Iterable[tuple[CID | str, bytes]], *, hashed: bool = False) -> None:
        """Store many blocks, several writes in flight at once.

        An fsync costs ~1-3 ms here whatever the block size, so one at a time caps an add near
        100 MB/s; overlapping them (the filesystem merges their journal commits) and overlapping
        them with the caller's hashing (``blocks`` may be a lazy importer) roughly doubles that.
        At most ``2 * WRITERS`` blocks are held in memory. ``hashed``: as for :meth:`put`.
        """
        in_flight: deque[Future[None]] = deque()
        with ThreadPoolExecutor(WRITERS, thread_name_prefix="blockstore-put") as pool:
            for cid, data in blocks:
                if len(in_flight) >= 2 * WRITERS:
                    in_flight.popleft().result()
                in_flight.append(pool.submit(self.put, cid, data, hashed=hashed))
            for future in in_flight:
                future.result()

    def delete(self, cid: CID | str) -> None:
        """Remove the block if held (no error if not)."""
        self._path(parse_cid(cid)).unlink(missing_ok=True)

    def iter_cids(self) -> Iterator[CID]:
        """Every held block, as a CIDv1 ``raw`` CID: the store keeps multihashes, not codecs (like Kubo)."""
        for path in self.block_files():
            multihash = _multihash_of(path)
            if multihash is not None:  # a stray file is not a block (repo verify lists it)
                yield CID("base32", 1, RAW, multihash)

    def block_files(self) -> Iterator[Path]:
        """Every ``*.data`` file in the shard folders, in a stable order (the quarantine is not a shard)."""
        for shard in sorted(self.root.iterdir()):
            if len(shard.name) == 2 and shard.is_dir():
                yield from sorted(shard.glob("*.data"))

    def verify(self, progress: Callable[[int], None] | None = None) -> Iterator[BadBlock]:
        """Read every block and yield those whose bytes do not hash to the multihash in their name.

        Read-only (nothing is quarantined: that is for a reader that needs the block), so it is safe
        next to a running node. ``progress`` is called with 1 per block checked.
        """
        for path in self.block_files():
            multihash = _multihash_of(path)
            cid = None if multihash is None else cid_str(CID("base32", 1, RAW, multihash))
            if multihash is None:
                yield BadBlock(path, None, "file name is not a sha2-256 multihash")
            else:
                try:
                    with open(path, "rb") as f:
                        data = f.read(MAX_BLOCK_SIZE + 1)
                except OSError as exc:
                    yield BadBlock(path, cid, f"unreadable: {exc.strerror or exc}")
                else:
                    if len(data) > MAX_BLOCK_SIZE:
                        yield BadBlock(path, cid, f"larger than {MAX_BLOCK_SIZE} bytes")
                    elif _SHA2_256_PREFIX + hashlib.sha256(data).digest() != multihash:
                        yield BadBlock(path, cid, f"{len(data)} bytes that do not hash to the name")
            if progress is not None:
                progress(1)

    @contextmanager
    def gc_lock(self) -> Iterator[None]:
        """Hold the pin lock: no pin is added or removed while a collection marks and sweeps."""
        with open(self.root / ".pins.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def sweep(
        self,
        keep: set[bytes],
        written_before: float,
        dry_run: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> Sweep:
        """Remove every block whose multihash is not in ``keep`` and whose file was last written
        (or re-put) before ``written_before`` (a ``time.time()``, less MTIME_SLACK_S): a block another
        process stored after the collection began is kept, whether or not a root reaches it yet."""
        result = Sweep()
        for path in self.block_files():
            multihash = _multihash_of(path)
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            if multihash is None or multihash in keep or st.st_mtime >= written_before - MTIME_SLACK_S:
                result.kept += 1
                result.kept_bytes += st.st_size
            else:
                if not dry_run:
                    path.unlink(missing_ok=True)
                result.removed += 1
                result.removed_bytes += st.st_size
                result.removed_cids.append(cid_str(CID("base32", 1, RAW, multihash)))
            if progress is not None:
                progress(1)
        return result

    def size_bytes(self) -> int:
        """Total bytes of held blocks (file contents, not disk usage)."""
        return sum(
            p.stat().st_size
            for shard in self.root.iterdir()
            if len(shard.name) == 2 and shard.is_dir()
            for p in shard.glob("*.data")
        )

    # ---- pins ----------------------------------------------------------------------------------

    @contextmanager
    def _pins_locked(self) -> Iterator[dict[str, str]]:
        """Read-modify-write the pin set under an exclusive lock; the new set is written atomically."""
        with open(self.root / ".pins.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            pins = self._read_pins()
            before = dict(pins)
            yield pins
            if pins != before:
                payload = {"version": PINS_VERSION, "pins": dict(sorted(pins.items()))}
                write_atomic(self.root / PINS_FILE, json.dumps(payload, indent=1).encode() + b"\n")

    def _read_pins(self) -> dict[str, str]:
        path = self.root / PINS_FILE
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_PINS_FILE_BYTES + 1)
        except FileNotFoundError:
            return {}
        return parse_pins(data, str(path))

    def pin_add(self, cid: CID | str, recursive: bool = True) -> None:
        key = cid_str(parse_cid(cid))
        with self._pins_locked() as pins:
            if pins.get(key) != RECURSIVE:  # a recursive pin is never downgraded, as in Kubo
                pins[key] = RECURSIVE if recursive else DIRECT

    def pin_rm(self, cid: CID | str) -> bool:
        """Unpin; returns False if ``cid`` was not pinned."""
        key = cid_str(parse_cid(cid))
        with self._pins_locked() as pins:
            return pins.pop(key, None) is not None

    def pin_ls(self) -> dict[str, str]:
        """``{cid: "recursive" | "direct"}``, as Kubo's ``pin ls`` reports them."""
        return self._read_pins()


def parse_pins(data: bytes, where: str = PINS_FILE) -> dict[str, str]:
    """The pin set in ``pins.json`` bytes; :class:`PinFileError` for anything else (bounded parse:
    size, nesting, numbers; every key must be a CID we accept)."""
    try:
        raw = boundedjson.loads(data, max_bytes=MAX_PINS_FILE_BYTES, what=where)
    except boundedjson.JSONBoundsError as exc:
        raise PinFileError(f"{where} is not a valid pin file: {exc}") from None
    if not isinstance(raw, dict) or raw.get("version") != PINS_VERSION:
        raise PinFileError(f"{where}: expected a version {PINS_VERSION} pin file")
    pins = raw.get("pins")
    if not isinstance(pins, dict) or not all(
        isinstance(k, str) and v in (RECURSIVE, DIRECT) for k, v in pins.items()
    ):
        raise PinFileError(f"{where}: 'pins' must map CIDs to 'recursive' or 'direct'")
    for key in pins:
        try:
            parse_cid(key)
        except InvalidCID as exc:
            raise PinFileError(f"{where}: {exc}") from None
    return pins
