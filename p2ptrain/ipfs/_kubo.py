"""The Kubo backend: a user's own IPFS daemon, through its HTTP RPC API, with nothing taken on trust.

``ipfshttpclient.connect()`` asks the daemon for its version and refuses (0.7) or warns about (0.8.0a2)
every Kubo newer than 0.8, and it has no option to skip the check. The constructor does not check:
:class:`KuboStore` builds ``ipfshttpclient.Client(multiaddr, ...)`` directly, which is the documented
way to skip it (see the class docstring of ``ipfshttpclient.Client``). The calls used here (add, cat,
block/get, refs, pin/add|rm|ls, version) have kept their shape across Kubo releases and js-ipfs.

The daemon is a separate program that may be misconfigured, out of date or compromised, so:

* **add** passes every import parameter explicitly (256 KiB chunks, CID version, raw leaves as Kubo's
  CLI sets them), computes the CID itself with :mod:`p2ptrain.ipfs._unixfs` over the same bytes, and
  fails if the daemon's CID differs (``Import.*`` settings in the daemon's config can change layouts);
* **cat/get** re-import the bytes the daemon returns and compare the CID; when the content was made
  with another layout (and so cannot be recomputed), every block is fetched with ``block/get`` and
  checked against its CID while the DAG is walked. Bytes that pass neither check are never returned.

Kubo's ``ipfs add`` pins what it adds (so the daemon's garbage collector keeps it); adds here do too.
"""

from __future__ import annotations

import io
import os
import secrets
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

import ipfshttpclient
from ipfshttpclient import exceptions as ipfs_errors

from p2ptrain.base import ArgumentError, UserError
from p2ptrain.ipfs._cid import CID, BlockMismatch, cid_str, parse_cid
from p2ptrain.ipfs._store import ContentUnavailable, Progress
from p2ptrain.ipfs._unixfs import CHUNK_SIZE, FileTooLarge, import_stream, read_file

__all__ = ["KuboStore", "api_multiaddr"]

# ipfshttpclient passes urllib3 an argument urllib3 2.x only warns about; the warning means nothing here.
warnings.filterwarnings("ignore", message="The 'strict' parameter", category=FutureWarning)

_READ = 1 << 20
# The daemon's address is open_store's ipfs_api= in Python, and --ipfs on the command line.
IPFS_FLAG = {"ipfs_api": "--ipfs"}


def api_multiaddr(api: str) -> str:
    """``http://127.0.0.1:5001`` (or a multiaddr already) -> ``/ip4/127.0.0.1/tcp/5001/http``."""
    if api.startswith("/"):
        return api
    parts = urlsplit(api if "://" in api else f"http://{api}")
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise ArgumentError("{ipfs_api}: expected an RPC API address like http://127.0.0.1:5001, not {api!r}", api=api,
                            flags=IPFS_FLAG)
    host = parts.hostname
    proto = "ip6" if ":" in host else "ip4" if host.replace(".", "").isdigit() else "dns"
    port = parts.port or (443 if parts.scheme == "https" else 5001)
    return f"/{proto}/{host}/tcp/{port}/{parts.scheme}"


class KuboStore:
    """A :class:`~p2ptrain.ipfs.ContentStore` backed by a Kubo (or js-ipfs) RPC API."""

    def __init__(self, api: str, timeout: float = 120.0) -> None:
        self.api = api
        # Client(), not connect(): connect() rejects current daemons by version (module docstring).
        try:
            self._client = ipfshttpclient.Client(api_multiaddr(api), timeout=timeout)
        except ipfs_errors.AddressError as exc:
            raise ArgumentError("{ipfs_api}: not a usable RPC API address {api!r}: {exc}", api=api, exc=exc,
                                flags=IPFS_FLAG) from None

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One RPC call; transport failures become one clear line naming the daemon."""
        try:
            return fn(*args, **kwargs)
        except ipfs_errors.ConnectionError as exc:
            raise UserError(f"cannot reach the IPFS RPC API at {self.api} ({what}): {exc}") from None
        except ipfs_errors.TimeoutError:
            raise UserError(f"the IPFS RPC API at {self.api} did not answer in time ({what})") from None
        except ipfs_errors.ErrorResponse:
            raise  # the daemon's own answer ("not pinned", "block not found"): the caller words it
        except ipfs_errors.CommunicationError as exc:
            raise UserError(f"the IPFS RPC API at {self.api} failed ({what}): {exc}") from None

    # ---- adding --------------------------------------------------------------------------------

    def _add(self, open_data: Callable[[], BinaryIO], cid_version: int, only_hash: bool,
             progress: Progress | None) -> str:
        if cid_version not in (0, 1):
            raise ValueError(f"cid_version must be 0 or 1, not {cid_version!r}")
        with open_data() as f:
            expected = _root_cid(f, cid_version, progress)
        with open_data() as f:
            reply = self._call(
                "add", self._client.add, f,
                cid_version=cid_version,
                raw_leaves=cid_version == 1,  # what Kubo's CLI does; the RPC API defaults to false
                chunker=f"size-{CHUNK_SIZE}",
                pin=True,
                only_hash=only_hash,
            )
        got = parse_cid(reply["Hash"])
        if got.digest != expected.digest or got.codec.name != expected.codec.name:
            raise BlockMismatch(
                expected,
                f"the daemon at {self.api} named this content {cid_str(got)}; check its Import.* "
                "settings (p2ptrain expects Kubo's defaults: 256 KiB chunks, balanced DAG)",
            )
        return cid_str(expected)

    def add_bytes(self, data: bytes, cid_version: int = 0, only_hash: bool = False) -> str:
        return self._add(lambda: io.BytesIO(data), cid_version, only_hash, None)

    def add_file(
        self,
        path: Path,
        cid_version: int = 0,
        only_hash: bool = False,
        progress: Progress | None = None,
    ) -> str:
        return self._add(lambda: open(path, "rb"), cid_version, only_hash, progress)

    # ---- reading -------------------------------------------------------------------------------

    def _stream_cat(
        self, cid: CID, sink: BinaryIO, progress: Progress | None, max_bytes: int | None = None
    ) -> None:
        def fetch() -> None:
            got = 0
            for chunk in self._client.cat(cid_str(cid), stream=True):
                got += len(chunk)
                if max_bytes is not None and got > max_bytes:
                    raise FileTooLarge(cid, f"file is over the {max_bytes} byte limit")
                sink.write(chunk)
                if progress:
                    progress(len(chunk))

        try:
            self._call("cat", fetch)
        except ipfs_errors.ErrorResponse as exc:
            raise ContentUnavailable(cid, f"the daemon at {self.api} says: {exc}") from None

    def _block(self, cid: CID) -> bytes:
        try:
            data: bytes = self._call("block/get", self._client.block.get, cid_str(cid))
            return data
        except ipfs_errors.ErrorResponse as exc:
            raise ContentUnavailable(cid, f"the daemon at {self.api} says: {exc}") from None

    def _verified_blocks(self, cid: CID, max_bytes: int | None = None) -> Iterator[bytes | memoryview]:
        """The file read block by block, each block checked against its CID (any DAG layout)."""
        return read_file(cid, self._block, max_bytes=max_bytes)

    def cat(self, cid: CID | str, max_bytes: int | None = None) -> bytes:
        cid = parse_cid(cid)
        buf = io.BytesIO()
        self._stream_cat(cid, buf, None, max_bytes)
        if _recomputes_to(cid, buf):
            return buf.getvalue()
        return b"".join(self._verified_blocks(cid, max_bytes))

    def get(self, cid: CID | str, out_path: Path, progress: Progress | None = None) -> None:
        """Stream to a temporary file, check it, then rename it into place (nothing partial appears)."""
        cid = parse_cid(cid)
        out_path = Path(out_path)
        tmp = out_path.with_name(f".{out_path.name}.{secrets.token_hex(6)}.part")
        try:
            with open(tmp, "w+b") as f:
                self._stream_cat(cid, f, progress)
                if not _recomputes_to(cid, f):
                    f.seek(0)
                    f.truncate()
                    for chunk in self._verified_blocks(cid):
                        f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, out_path)
        finally:
            tmp.unlink(missing_ok=True)

    def has(self, cid: CID | str) -> bool:
        """Whether the daemon holds the whole DAG without asking its network.

        ``offline`` makes Kubo answer at once for a missing block; js-ipfs ignores it and searches,
        so a short timeout bounds that case.
        """
        cid = parse_cid(cid)
        try:
            self._client.unstable.refs(
                cid_str(cid), opts={"recursive": True}, offline=True, timeout=10
            )
            self._client.block.stat(cid_str(cid), offline=True, timeout=10)
        except (ipfs_errors.ErrorResponse, ipfs_errors.TimeoutError):
            return False
        except ipfs_errors.ConnectionError as exc:
            raise UserError(f"cannot reach the IPFS RPC API at {self.api}: {exc}") from None
        return True

    # ---- pins ----------------------------------------------------------------------------------

    def pin_add(self, cid: CID | str, recursive: bool = True) -> None:
        cid = parse_cid(cid)
        try:
            self._call("pin/add", self._client.pin.add, cid_str(cid), recursive=recursive)
        except ipfs_errors.ErrorResponse as exc:
            raise ContentUnavailable(cid, f"the daemon at {self.api} cannot pin it: {exc}") from None

    def pin_rm(self, cid: CID | str) -> None:
        cid = parse_cid(cid)
        try:
            self._call("pin/rm", self._client.pin.rm, cid_str(cid))
        except ipfs_errors.ErrorResponse as exc:
            raise ContentUnavailable(cid, f"not pinned ({exc})") from None

    def pin_ls(self) -> dict[str, str]:
        """Recursive and direct pins (indirect ones, the blocks under a recursive pin, are left out)."""
        reply = self._call("pin/ls", self._client.pin.ls, type="all")
        pins = {}
        for key, info in reply["Keys"].items():
            kind = info["Type"]
            if kind in ("recursive", "direct"):
                pins[cid_str(parse_cid(key))] = kind
        return pins


def _root_cid(stream: BinaryIO, cid_version: int, progress: Progress | None) -> CID:
    last = deque(import_stream(stream, cid_version=cid_version, progress=progress), maxlen=1)
    assert last  # the importer always yields a root (its last block), even for empty input
    return last[0][0]


def _recomputes_to(cid: CID, f: BinaryIO) -> bool:
    """Whether the bytes in ``f`` import (with Kubo's CLI defaults for ``cid``'s version) to ``cid``."""
    f.seek(0)
    root = _root_cid(f, cid.version, None)
    f.seek(0, io.SEEK_END)
    return root.digest == cid.digest and root.codec.name == cid.codec.name
