"""The default content backend: the Kubo-compatible importer over the node's own block store.

A block the store lacks (or holds corrupted) is asked of ``fetch_block``, the network exchange the node
plugs in; its answer is verified and kept, so the next read is local. Without one, a missing block is a
:class:`~p2ptrain.ipfs.ContentUnavailable` that names the CID.
"""

from __future__ import annotations

import io
import os
import secrets
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from p2ptrain.ipfs._blockstore import BlockNotFound, BlockStore, CorruptBlock
from p2ptrain.ipfs._cid import CID, RAW, BlockMismatch, cid_str, parse_cid
from p2ptrain.ipfs._store import ContentUnavailable, Progress
from p2ptrain.ipfs._unixfs import DagError, import_stream, read_file, walk_dag


class EmbeddedStore:
    """A :class:`~p2ptrain.ipfs.ContentStore` whose blocks live in ``<home>/blocks``."""

    def __init__(self, home: Path, fetch_block: Callable[[CID], bytes] | None = None) -> None:
        self.home = Path(home)
        self.blocks = BlockStore(self.home / "blocks")
        self.fetch_block = fetch_block

    # ---- blocks --------------------------------------------------------------------------------

    def block(self, cid: CID | str) -> bytes:
        """One verified block: from disk, else from ``fetch_block`` (then stored), else an error."""
        cid = parse_cid(cid)
        try:
            return self.blocks.get(cid)
        except BlockNotFound:
            why = "is not held locally"
        except CorruptBlock:
            why = "was corrupt on disk (now quarantined)"
        if self.fetch_block is None:
            raise ContentUnavailable(
                cid, f"block {why} in {self.blocks.root}, and no network fetcher is attached"
            )
        try:
            data = self.fetch_block(cid)
        except ContentUnavailable:
            raise
        except Exception as exc:  # the fetcher's failure is the user's answer: say which CID
            raise ContentUnavailable(cid, f"block {why}; fetching it failed: {exc}") from exc
        try:
            self.blocks.put(cid, data)  # verifies
        except BlockMismatch as exc:
            raise ContentUnavailable(cid, f"fetched block rejected: {exc}") from None
        return data

    # ---- adding --------------------------------------------------------------------------------

    def add_stream(
        self,
        stream: BinaryIO,
        cid_version: int = 0,
        only_hash: bool = False,
        progress: Progress | None = None,
    ) -> str:
        """Import ``stream`` as a UnixFS file; store its blocks unless ``only_hash``; return the CID."""
        last: list[CID] = []  # the last block is the root; the empty file still has one

        def blocks() -> Iterator[tuple[CID, bytes]]:
            for cid, data in import_stream(stream, cid_version=cid_version, progress=progress):
                last[:] = [cid]
                yield cid, data

        if only_hash:
            for _ in blocks():
                pass
        else:
            self.blocks.put_many(blocks(), hashed=True)  # the importer named each block by its hash
        return cid_str(last[0])

    def add_bytes(self, data: bytes, cid_version: int = 0, only_hash: bool = False) -> str:
        return self.add_stream(io.BytesIO(data), cid_version, only_hash)

    def add_file(
        self,
        path: Path,
        cid_version: int = 0,
        only_hash: bool = False,
        progress: Progress | None = None,
    ) -> str:
        with open(path, "rb") as f:
            return self.add_stream(f, cid_version, only_hash, progress)

    # ---- reading -------------------------------------------------------------------------------

    def iter_cat(self, cid: CID | str, max_bytes: int | None = None) -> Iterator[bytes | memoryview]:
        """The file's bytes in order, chunk by chunk, each block verified (a file need not fit in RAM);
        a file declared larger than ``max_bytes`` fails with ``FileTooLarge`` before it is read."""
        return read_file(parse_cid(cid), self.block, verified=True, max_bytes=max_bytes)  # self.block verifies

    def cat(self, cid: CID | str, max_bytes: int | None = None) -> bytes:
        return b"".join(self.iter_cat(cid, max_bytes))

    def get(self, cid: CID | str, out_path: Path, progress: Progress | None = None) -> None:
        out_path = Path(out_path)
        tmp = out_path.with_name(f".{out_path.name}.{secrets.token_hex(6)}.part")
        try:
            with open(tmp, "xb") as f:
                for chunk in self.iter_cat(cid):
                    f.write(chunk)
                    if progress:
                        progress(len(chunk))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, out_path)
        finally:
            tmp.unlink(missing_ok=True)

    def has(self, cid: CID | str) -> bool:
        """Whether every block of the DAG is on disk. Cheap for CIDv1 files: raw leaves are only
        looked up, not read (a rotten one is still caught, and refetched, when it is read). A DAG
        this store cannot walk (too deep, a block that is not dag-pb) is not "held": the fetch that
        follows says why."""

        def local(c: CID) -> bytes | None:
            if c.codec.name == RAW:
                if not self.blocks.has(c):
                    raise BlockNotFound(c)
                return None
            return self.blocks.get(c)

        try:
            for _ in walk_dag(parse_cid(cid), local):
                pass
        except (BlockNotFound, CorruptBlock, DagError):
            return False
        return True

    def reachable(self, recursive: Iterable[CID | str], direct: Iterable[CID | str] = ()) -> set[bytes]:
        """The multihashes of every held block under ``recursive`` roots, plus the ``direct`` roots.

        The mark phase of ``repo gc``: each distinct block is read once (:func:`walk_dag`); a block
        that is missing ends its branch (nothing below it can be known, nor kept). A reachable block
        that is corrupt or a DAG that cannot be walked raises (:class:`CorruptBlock`,
        :class:`DagError`): a collection that cannot see what a root needs must not delete anything.
        """
        keep = {parse_cid(c).digest for c in direct}

        def held(c: CID) -> bytes | None:
            try:
                return self.blocks.get(c) if c.codec.name != RAW else None
            except BlockNotFound:
                return None

        for root in recursive:
            keep.update(c.digest for c in walk_dag(parse_cid(root), held))
        return keep

    # ---- pins ----------------------------------------------------------------------------------

    def pin_add(self, cid: CID | str, recursive: bool = True) -> None:
        """Pin ``cid`` after making it local: the whole DAG if ``recursive``, else its root block."""
        cid = parse_cid(cid)
        if recursive and not self.has(cid):  # has() only stats raw leaves: pinning what was just added is cheap
            for _ in walk_dag(cid, self.block):  # fetches what is missing; DagError for a DAG too deep
                pass
        else:
            self.block(cid)
        self.blocks.pin_add(cid, recursive)

    def pin_rm(self, cid: CID | str) -> None:
        if not self.blocks.pin_rm(cid):
            raise ContentUnavailable(cid, "not pinned")

    def pin_ls(self) -> dict[str, str]:
        return self.blocks.pin_ls()
