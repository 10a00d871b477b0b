"""Files as IPFS DAGs, byte-for-byte like Kubo's ``ipfs add`` defaults, and back again.

Importing: 256 KiB fixed-size chunks; a balanced tree of at most 174 links per node; CIDv0 with dag-pb
UnixFS leaves, or (``cid_version=1``) CIDv1 with raw leaves, as Kubo's CLI does. Matching Kubo exactly
is the point: a CID we print must name the same bytes on any IPFS node. The importer streams (one chunk
and one pending link list per tree level in memory) and yields blocks leaves-first, the root last.

Reading walks a DAG through a block getter and verifies every block against the CID that named it, so
the bytes it yields are the ones the root CID promises, whoever served them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from p2ptrain.ipfs._cid import CID, DAG_PB, RAW, cid_from_digest, cid_str, verify_block
from p2ptrain.ipfs._dagpb import FILE, RAW_TYPE, DecodeError, decode_node, decode_unixfs, encode_file_leaf, encode_file_node

CHUNK_SIZE = 256 * 1024
MAX_LINKS = 174
# log_174 of any real file size is < 10 (174**9 leaves of 256 KiB is past any disk); a deeper DAG is
# malicious or broken. Every walk (read, has, pin, gc, verify, fetch) refuses to go below it, which also
# keeps a 1,100-block chain from being walked at all.
MAX_DEPTH = 32

Block = tuple[CID, bytes]

# Block bytes a file's DAG takes beyond the file's own, per CHUNK_SIZE chunk: a dag-pb leaf wraps
# its chunk in 14 bytes, and each link above it (hash, size, blocksize) takes under 62; measured
# 63 a chunk with CIDv0 and 51 with raw leaves. 128 is twice that, and DAG_SLACK covers the root.
DAG_BYTES_PER_CHUNK = 128
DAG_SLACK = 4096


def dag_bytes_limit(file_bytes: int) -> int:
    """The most block bytes the DAG of a file of ``file_bytes`` takes in Kubo's default layout
    (what a fetch counts as blocks arrive): the bound to fetch a file with when only its size is
    known. A file chunked finer than CHUNK_SIZE (``ipfs add --chunker``) may take more."""
    return file_bytes + (file_bytes // CHUNK_SIZE + 1) * DAG_BYTES_PER_CHUNK + DAG_SLACK


@dataclass(frozen=True)
class _Link:
    cid: CID
    tsize: int  # bytes of the whole subtree's blocks (dag-pb's Tsize)
    filesize: int  # bytes of file content under it


class _Chunker:
    """Fixed-size chunks of a stream with one chunk of look-ahead, so "done" is known before reading."""

    def __init__(self, stream: BinaryIO, size: int, progress: Callable[[int], None] | None) -> None:
        self._stream, self._size, self._progress = stream, size, progress
        self._next = self._read()

    def _read(self) -> bytes:
        data = self._stream.read(self._size)
        while data and len(data) < self._size:  # short reads from pipes and raw files
            more = self._stream.read(self._size - len(data))
            if not more:
                break
            data += more
        return data

    @property
    def done(self) -> bool:
        return not self._next

    def take(self) -> bytes:
        chunk, self._next = self._next, self._read()
        if self._progress:
            self._progress(len(chunk))
        return chunk


class _Importer:
    def __init__(self, chunker: _Chunker, cid_version: int, raw_leaves: bool) -> None:
        self.chunks, self.version, self.raw_leaves = chunker, cid_version, raw_leaves

    def _leaf(self, chunk: bytes) -> Generator[Block, None, _Link]:
        if self.raw_leaves:
            cid = cid_from_digest(hashlib.sha256(chunk).digest(), RAW, 1)
            block = chunk
        else:
            block = encode_file_leaf(chunk)
            cid = cid_from_digest(hashlib.sha256(block).digest(), DAG_PB, self.version)
        yield cid, block
        return _Link(cid, len(block), len(chunk))

    def _node(self, children: list[_Link]) -> Generator[Block, None, _Link]:
        block = encode_file_node(
            [(bytes(c.cid), c.tsize) for c in children], [c.filesize for c in children]
        )
        cid = cid_from_digest(hashlib.sha256(block).digest(), DAG_PB, self.version)
        yield cid, block
        return _Link(
            cid, len(block) + sum(c.tsize for c in children), sum(c.filesize for c in children)
        )

    def _fill(self, children: list[_Link], depth: int) -> Generator[Block, None, _Link]:
        """go-unixfs' fillNodeRec: fill a node of ``depth`` with up to 174 full subtrees."""
        while len(children) < MAX_LINKS and not self.chunks.done:
            if depth == 1:
                child = yield from self._leaf(self.chunks.take())
            else:
                child = yield from self._fill([], depth - 1)
            children.append(child)
        return (yield from self._node(children))

    def layout(self) -> Generator[Block, None, _Link]:
        """go-unixfs' balanced layout: grow a new root above the old one whenever the tree is full."""
        root = yield from self._leaf(self.chunks.take())  # the empty file is one empty leaf
        depth = 1
        while not self.chunks.done:
            root = yield from self._fill([root], depth)
            depth += 1
        return root


def import_stream(
    stream: BinaryIO,
    cid_version: int = 0,
    raw_leaves: bool | None = None,
    progress: Callable[[int], None] | None = None,
) -> Iterator[Block]:
    """Yield the blocks of ``stream`` as a UnixFS file, leaves first; the last block is the root.

    ``raw_leaves`` defaults to Kubo's CLI choice: raw leaves with CIDv1, UnixFS leaves with CIDv0.
    ``progress`` is called with the byte count of each chunk read (``tqdm.update`` fits).
    """
    if cid_version not in (0, 1):
        raise ValueError(f"cid_version must be 0 or 1, not {cid_version!r}")
    if raw_leaves is None:
        raw_leaves = cid_version == 1
    if raw_leaves and cid_version == 0:
        raise ValueError("raw leaves need CIDv1")
    importer = _Importer(_Chunker(stream, CHUNK_SIZE, progress), cid_version, raw_leaves)
    yield from importer.layout()


class DagError(ValueError):
    """A DAG that is not a UnixFS file we can read (wrong type, inconsistent sizes, too deep)."""

    def __init__(self, cid: CID, message: str) -> None:
        super().__init__(f"{cid_str(cid)}: {message}")
        self.cid = cid


class FileTooLarge(DagError):
    """The file is larger than the reader was allowed to read (its declared size says so up front)."""


# The reader keeps the output of small subtrees it has read, by CID, for the rest of the read: a block
# linked many times (legal: a file of zeros) is then read, hashed and walked once, and a DAG whose
# links all lead to one tiny subtree (a "bomb" with 1-byte leaves: 66 µs per visit, 5 minutes for a
# 23 KB DAG of three levels) costs one visit per cached subtree instead of one per byte.
# Subtrees up to one chunk (256 KiB) are kept, 8 MiB at most (least recently used goes first).
MAX_CACHED_SUBTREE = CHUNK_SIZE
READ_CACHE_BYTES = 8 * 1024 * 1024


class _ReadCache:
    """Outputs of validated subtrees of one read, keyed by codec and multihash, LRU under a byte budget."""

    def __init__(self) -> None:
        self.items: dict[tuple[int, bytes], bytes] = {}
        self.size = 0

    def get(self, cid: CID) -> bytes | None:
        key = (cid.codec.code, cid.digest)
        data = self.items.pop(key, None)
        if data is not None:
            self.items[key] = data  # most recently used last
        return data

    def put(self, cid: CID, data: bytes) -> None:
        self.items[(cid.codec.code, cid.digest)] = data
        self.size += len(data)
        while self.size > READ_CACHE_BYTES:
            self.size -= len(self.items.pop(next(iter(self.items))))


def read_file(
    root: CID,
    get_block: Callable[[CID], bytes],
    verified: bool = False,
    max_bytes: int | None = None,
) -> Iterator[bytes | memoryview]:
    """Yield the content of the UnixFS file ``root`` in order, verifying every block it fetches.

    ``verified=True`` says ``get_block`` itself only returns blocks it checked against their CID
    (the embedded store does), so they are not hashed twice. Chunks of dag-pb leaves are views into
    their blocks (no copy); join or write them.

    Checks that each node's declared filesize is the sum of its own data and its blocksizes, and
    that each subtree yields exactly the size its parent declares, so a DAG cannot claim one length
    and deliver another. A link to an empty subtree is refused (no importer makes one, and it is
    what lets a 23 KB DAG of links to one empty child cost 174**depth visits for 0 bytes): so every
    block visited yields at least one byte, and subtrees up to MAX_CACHED_SUBTREE read once are
    served from memory after, so the work is bounded by the output. ``max_bytes`` bounds the
    output: a root that declares more fails with :class:`FileTooLarge` before any child is read.
    Raises :class:`~p2ptrain.ipfs.BlockMismatch` for a block whose hash is wrong and
    :class:`DagError` for a well-hashed but unusable DAG.
    """
    yield from _read(root, get_block, verified, None, 0, _ReadCache(), max_bytes)


def _read(
    cid: CID,
    get_block: Callable[[CID], bytes],
    verified: bool,
    expect: int | None,
    depth: int,
    cache: _ReadCache,
    max_bytes: int | None = None,
) -> Iterator[bytes | memoryview]:
    if depth > MAX_DEPTH:
        raise DagError(cid, f"DAG deeper than {MAX_DEPTH} levels")
    cached = cache.get(cid)
    if cached is not None:
        if expect is not None and len(cached) != expect:
            raise DagError(cid, f"subtree holds {len(cached)} bytes of file, parent says {expect}")
        yield cached
        return
    block = get_block(cid)
    if not verified:
        verify_block(cid, block)
    if cid.codec.name == RAW:
        if expect is not None and len(block) != expect:
            raise DagError(cid, f"raw leaf has {len(block)} bytes, parent says {expect}")
        if max_bytes is not None and len(block) > max_bytes:
            raise FileTooLarge(cid, f"file of {len(block)} bytes is over the {max_bytes} byte limit")
        yield block
        return
    try:
        node = decode_node(block)
        if node.data is None:
            raise DecodeError("dag-pb node without UnixFS data")
        meta = decode_unixfs(node.data)
    except DecodeError as exc:
        raise DagError(cid, f"not a UnixFS file node: {exc}") from None
    if meta.type not in (FILE, RAW_TYPE):
        raise DagError(cid, f"UnixFS type {meta.type} is not a file (directories are not supported)")
    if len(meta.blocksizes) != len(node.links):
        raise DagError(cid, f"{len(node.links)} links but {len(meta.blocksizes)} block sizes")
    if 0 in meta.blocksizes:
        raise DagError(cid, "a link to an empty subtree (no importer makes one; refused as a DAG bomb)")
    own = len(meta.data) if meta.data is not None else 0
    total = own + sum(meta.blocksizes)
    for declared in (meta.filesize, expect):
        if declared is not None and declared != total:
            raise DagError(cid, f"node holds {total} bytes of file, but {declared} are declared")
    if max_bytes is not None and total > max_bytes:
        raise FileTooLarge(cid, f"file of {total} bytes is over the {max_bytes} byte limit")
    children = zip(node.links, meta.blocksizes)
    if total > MAX_CACHED_SUBTREE or not node.links:  # stream it (a leaf is its block: nothing to keep)
        if meta.data:
            yield meta.data
        for link, size in children:
            yield from _read(link.cid, get_block, verified, size, depth + 1, cache)
        return
    parts: list[bytes | memoryview] = [meta.data] if meta.data else []
    for link, size in children:
        parts.extend(_read(link.cid, get_block, verified, size, depth + 1, cache))
    data = b"".join(parts)
    cache.put(cid, data)
    yield data


def walk_dag(
    root: CID, get_block: Callable[[CID], bytes | None], max_depth: int = MAX_DEPTH
) -> Iterator[CID]:
    """Yield every distinct block of the DAG under ``root`` once, breadth first, without recursion.

    ``get_block`` returns a block's bytes, or None where its links need not be read (a raw leaf that
    is only looked up); it raises for a missing block. A block linked many times (legal: Kubo links
    one chunk of zeros under every position of a file of zeros) is visited once, so the walk costs
    one visit per distinct block whatever the DAG's shape; :class:`DagError` for a block deeper than
    ``max_depth`` links or a dag-pb block that does not decode. Blocks are told apart by codec and
    multihash: the same bytes named raw have no links to follow.
    """
    seen = {(root.codec.code, root.digest)}
    level = [root]
    depth = 0
    while level:
        if depth > max_depth:
            raise DagError(level[0], f"DAG deeper than {max_depth} levels")
        below: list[CID] = []
        for cid in level:
            data = get_block(cid)
            yield cid
            if data is None or cid.codec.name != DAG_PB:
                continue
            try:
                links = decode_node(data).links
            except DecodeError as exc:
                raise DagError(cid, f"not a dag-pb node: {exc}") from None
            for link in links:
                key = (link.cid.codec.code, link.cid.digest)
                if key not in seen:
                    seen.add(key)
                    below.append(link.cid)
        level = below
        depth += 1
