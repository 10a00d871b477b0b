"""The one small interface every content backend implements, and the factory that picks a backend.

Callers (the CLI, the data loader, the node) hold a :class:`ContentStore` and never care whether bytes
come from the embedded block store or from a user's Kubo daemon: both name content with the same CIDs
(Kubo's ``ipfs add`` defaults) and both return only verified bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from p2ptrain.ipfs._cid import CID, cid_str

Progress = Callable[[int], None]
"""Called with the number of bytes just processed (``tqdm.update`` fits)."""


class ContentUnavailable(LookupError):
    """Content named by a CID cannot be had: not held locally and not fetchable (the reason says why)."""

    def __init__(self, cid: CID | str, reason: str) -> None:
        self.cid = cid_str(cid) if isinstance(cid, CID) else cid
        self.reason = reason
        super().__init__(f"{self.cid}: {reason}")


class BlockSource(Protocol):
    """What Bitswap needs of a block store (:class:`~p2ptrain.ipfs.BlockStore` fits).

    ``get`` must verify what it returns; ``put`` must verify and write atomically. All are called
    from worker threads.
    """

    def has(self, cid: CID) -> bool: ...

    def get(self, cid: CID) -> bytes: ...

    def put(self, cid: CID, data: bytes) -> None: ...

    def delete(self, cid: CID) -> None:
        """Remove the block if held (a fetch refused its content)."""
        ...


@runtime_checkable
class ContentStore(Protocol):
    """Add, read and pin UnixFS files by CID. CIDs are returned as strings in Kubo's text form."""

    def add_bytes(self, data: bytes, cid_version: int = 0, only_hash: bool = False) -> str: ...

    def add_file(
        self,
        path: Path,
        cid_version: int = 0,
        only_hash: bool = False,
        progress: Progress | None = None,
    ) -> str: ...

    def cat(self, cid: CID | str, max_bytes: int | None = None) -> bytes:
        """The whole file; a file larger than ``max_bytes`` raises ``unixfs.FileTooLarge`` without
        being read to the end (callers reading untrusted CIDs into memory pass a bound)."""
        ...

    def get(self, cid: CID | str, out_path: Path, progress: Progress | None = None) -> None:
        """Write the file to ``out_path`` atomically (nothing appears there unless it is complete)."""
        ...

    def pin_add(self, cid: CID | str, recursive: bool = True) -> None: ...

    def pin_rm(self, cid: CID | str) -> None: ...

    def pin_ls(self) -> dict[str, str]:
        """``{cid: "recursive" | "direct"}``."""
        ...

    def has(self, cid: CID | str) -> bool:
        """True when the whole DAG is held locally, so ``cat`` needs no network."""
        ...


def open_store(
    home: Path,
    ipfs_api: str | None = None,
    fetch_block: Callable[[CID], bytes] | None = None,
) -> ContentStore:
    """The embedded store of ``home``, or the Kubo daemon at ``ipfs_api`` (``http://host:port``).

    ``fetch_block`` is the embedded store's source for blocks it does not hold (the node's network
    exchange); Kubo fetches from its own network.
    """
    if ipfs_api:
        from p2ptrain.ipfs._kubo import KuboStore

        return KuboStore(ipfs_api)
    from p2ptrain.ipfs._embedded import EmbeddedStore

    return EmbeddedStore(home, fetch_block=fetch_block)
