"""The importer gives Kubo's CIDs (vectors from Kubo's ``ipfs add``), and the reader gives back the bytes."""

import io

import pytest

from p2ptrain.ipfs import (
    BlockMismatch,
    CHUNK_SIZE,
    DAG_PB,
    DagError,
    MAX_LINKS,
    cid_str,
    encode_file_node,
    import_stream,
    make_cid,
    parse_cid,
    read_file,
)

# (content length, CIDv0 default, CIDv1 raw leaves); content = bytes(i % 251 for i in range(n)).
VECTORS = [
    (0, "QmbFMke1KXqnYyBBWxB74N4c5SBnJMVAiMNRcGu6x1AwQH",
     "bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku"),
    (1, "QmS9JArPwa55ePgDnyg6TzX24mYTS1b1vLqWNebyVotKxQ",
     "bafkreidogqfzz75tpkmjzjke425xqcrmpcib2p5tg44hnbirumdbpl5adu"),
    (262145, "QmUSjGawaz4ptvREcMKSMJneWCa5j8dAz2wSAAvHtW2rnB",
     "bafybeiexg2oqkfnj56l7fcmawswqbijt5shq4b5rg6a546uwpkqqzwjioi"),
    (1048576, "QmXgkY4miMKJBrg8YYke4xw6C2n8WNsUc1GXLhN84k4QM3",
     "bafybeiedpcapwld4tkgtzwahfofgn4wex5ryysf4se6hwpmlrsh4ntnrau"),
    # 174 chunks fill one node; this needs two levels of inner nodes.
    (45613057, "QmTedsTekQQkgACJXb1sPZSW8bLdS9LPMrT7L4YdjNRd4n",
     "bafybeib4y7ghw2rq7bracc4xwtxrbzo7cfvagdpte2tmrkgwl6dyard3cm"),
]
HELLO = b"hello world\n"


def pattern(n: int) -> bytes:
    period = bytes(range(251))
    return period * (n // 251) + period[: n % 251]


def add(data: bytes, cid_version: int = 0) -> tuple[str, dict]:
    blocks = list(import_stream(io.BytesIO(data), cid_version=cid_version))
    return cid_str(blocks[-1][0]), {bytes(c.digest): b for c, b in blocks}


def test_pattern_matches_definition():
    assert pattern(1000) == bytes(i % 251 for i in range(1000))


@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("n,v0,v1", VECTORS, ids=[str(v[0]) for v in VECTORS])
def test_kubo_vectors_and_round_trip(n, v0, v1, version):
    data = pattern(n)
    root, blocks = add(data, version)
    assert root == (v0, v1)[version]
    back = b"".join(read_file(parse_cid(root), lambda c: blocks[bytes(c.digest)]))
    assert back == data


def test_hello_world():
    assert add(HELLO)[0] == "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
    assert add(HELLO, 1)[0] == "bafkreifjjcie6lypi6ny7amxnfftagclbuxndqonfipmb64f2km2devei4"


def test_tree_shape_is_balanced_with_174_links():
    n = CHUNK_SIZE * (MAX_LINKS + 1)
    blocks = list(import_stream(io.BytesIO(pattern(n)), cid_version=1))
    # 175 raw leaves, one full inner node of 174, one node holding the last leaf, one root of 2.
    assert sum(c.codec.name == "raw" for c, _ in blocks) == MAX_LINKS + 1
    assert sum(c.codec.name == "dag-pb" for c, _ in blocks) == 3


class Trickle(io.RawIOBase):
    """A stream that returns at most 1000 bytes per read, like a pipe."""

    def __init__(self, data: bytes):
        self._buf = io.BytesIO(data)

    def readable(self):
        return True

    def read(self, n=-1):
        return self._buf.read(min(n, 1000) if n >= 0 else 1000)


def test_short_reads_give_the_same_cid():
    n, v0, _ = VECTORS[3]
    blocks = list(import_stream(Trickle(pattern(n))))
    assert cid_str(blocks[-1][0]) == v0


def test_progress_counts_every_byte():
    seen = []
    list(import_stream(io.BytesIO(pattern(600_000)), progress=seen.append))
    assert sum(seen) == 600_000


def test_reader_rejects_a_block_that_does_not_match_its_cid():
    root, blocks = add(pattern(3 * CHUNK_SIZE))
    leaf = next(k for k, v in blocks.items() if len(v) > CHUNK_SIZE)
    blocks[leaf] = blocks[leaf][:-1] + b"\x00"
    with pytest.raises(BlockMismatch):
        b"".join(read_file(parse_cid(root), lambda c: blocks[bytes(c.digest)]))


def test_reader_rejects_sizes_that_lie():
    # A well-hashed node that claims its one child holds more bytes than it does.
    leaf = make_cid(b"abc")
    node = encode_file_node([(bytes(leaf), 3)], [4])
    root = make_cid(node, DAG_PB, 0)
    store = {bytes(leaf.digest): b"abc", bytes(root.digest): node}
    with pytest.raises(DagError, match="raw leaf has 3 bytes, parent says 4"):
        b"".join(read_file(root, lambda c: store[bytes(c.digest)]))


def test_reader_refuses_a_non_unixfs_dag_pb_node():
    node = b"\x0a\x03abc"  # Data is not a UnixFS message
    root = make_cid(node, DAG_PB, 0)
    with pytest.raises(DagError, match="not a UnixFS file node"):
        list(read_file(root, lambda c: node))


def test_cid_version_is_checked():
    with pytest.raises(ValueError):
        list(import_stream(io.BytesIO(b"x"), cid_version=2))


def test_reader_rejects_a_filesize_that_lies():
    leaf = make_cid(b"abc")
    link = b"\x0a" + bytes([len(bytes(leaf))]) + bytes(leaf) + b"\x12\x00\x18\x03"
    unixfs = b"\x08\x02\x18\x05\x20\x03"  # filesize 5, one child of 3 bytes
    node = b"\x12" + bytes([len(link)]) + link + b"\x0a" + bytes([len(unixfs)]) + unixfs
    root = make_cid(node, DAG_PB, 0)
    store = {bytes(leaf.digest): b"abc", bytes(root.digest): node}
    with pytest.raises(DagError, match="3 bytes of file, but 5 are declared"):
        b"".join(read_file(root, lambda c: store[bytes(c.digest)]))
