"""The dag-pb / UnixFS decoders accept what Kubo makes and reject garbage with DecodeError only."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.ipfs import (
    DecodeError,
    InvalidCID,
    decode_node,
    decode_unixfs,
    encode_file_leaf,
    encode_file_node,
    make_cid,
    parse_cid,
    varint,
)
from p2ptrain.ipfs._dagpb import FILE

LEAF = make_cid(b"leaf")


@given(st.binary(max_size=300))
@settings(max_examples=400, deadline=None)
def test_random_bytes_decode_or_raise_decode_error(data):
    for decode in (decode_node, decode_unixfs):
        try:
            decode(data)
        except DecodeError:
            pass


@given(
    st.lists(st.tuples(st.binary(min_size=1, max_size=50), st.integers(0, 2**40)), max_size=20),
    st.data(),
)
@settings(max_examples=100, deadline=None)
def test_inner_nodes_round_trip_and_survive_mutation(links_data, data):
    links = [(bytes(make_cid(payload)), tsize) for payload, tsize in links_data]
    sizes = [t for _, t in links]
    block = encode_file_node(links, sizes)
    node = decode_node(block)
    assert [bytes(link.cid) for link in node.links] == [c for c, _ in links]
    assert [link.tsize for link in node.links] == sizes
    meta = decode_unixfs(node.data)
    assert (meta.type, meta.filesize, meta.blocksizes) == (FILE, sum(sizes), sizes)
    # Flip one byte anywhere: the result is a valid node or a DecodeError, never a crash.
    i = data.draw(st.integers(0, len(block) - 1))
    mutated = block[:i] + bytes([block[i] ^ data.draw(st.integers(1, 255))]) + block[i + 1 :]
    try:
        decode_unixfs(decode_node(mutated).data or b"")
    except DecodeError:
        pass


def test_leaf_round_trip():
    node = decode_node(encode_file_leaf(b"hello"))
    assert node.links == []
    meta = decode_unixfs(node.data)
    assert (meta.type, meta.data, meta.filesize) == (FILE, b"hello", 5)


@pytest.mark.parametrize(
    "block,why",
    [
        (b"\x0a", "truncated"),
        (b"\x0a\x05ab", "claims 5 bytes"),
        (b"\x1a\x00", "unknown PBNode field"),
        (b"\x08\x01", "wire type"),
        (b"\x0a\x00\x12\x00", "after Data"),  # Data before a link
        (b"\x0a\x00\x0a\x00", "after Data"),  # two Data fields
        (b"\x12\x00", "without a hash"),
        (b"\x0a\x81\x00", "non-minimal"),
        (b"\x0a" + b"\xff" * 11, "longer than 10"),
        (b"\x12\x04\x0a\x02\x12\x20", "PBLink hash"),
        (b"\x0b", "wire type"),
    ],
)
def test_decode_node_rejects(block, why):
    with pytest.raises(DecodeError, match=why):
        decode_node(block)


def test_link_fields_must_be_in_order():
    cid = bytes(LEAF)
    link = b"\x12\x00" + b"\x0a" + varint(len(cid)) + cid  # Name before Hash
    with pytest.raises(DecodeError, match="out of order"):
        decode_node(b"\x12" + varint(len(link)) + link)


@pytest.mark.parametrize(
    "data,why",
    [
        (b"", "without a type"),
        (b"\x08\x09", "unknown UnixFS type"),
        (b"\x08\x02\x08\x02", "repeated"),
        (b"\x08\x02\x50\x00", "unknown UnixFS field"),
        (b"\x08\x02\x12\x01", "claims 1 bytes"),
    ],
)
def test_decode_unixfs_rejects(data, why):
    with pytest.raises(DecodeError, match=why):
        decode_unixfs(data)


def test_parse_cid_refuses_other_hashes_and_codecs():
    with pytest.raises(InvalidCID, match="hash"):
        parse_cid("bafkr4ihkr4ld3m4gqkjf4reryxsy2s5tkbxprqkow6fin2iiyvreuzzab4")  # blake3
    with pytest.raises(InvalidCID, match="codec"):
        parse_cid("bafyreidykglsfhoixmivffc5uwhcgshx4j465xwqntbmu43nb2dzqwfvae")  # dag-cbor
    with pytest.raises(InvalidCID):
        parse_cid("Qm" + "1" * 44)


def test_decode_node_bounds_links_and_names():
    from p2ptrain.ipfs._dagpb import MAX_LINK_NAME_BYTES, MAX_LINKS_PER_NODE

    link = b"\x0a" + varint(len(bytes(LEAF))) + bytes(LEAF)
    many = (b"\x12" + varint(len(link)) + link) * (MAX_LINKS_PER_NODE + 1)
    with pytest.raises(DecodeError, match="links in one node"):
        decode_node(many)
    assert len(decode_node((b"\x12" + varint(len(link)) + link) * MAX_LINKS_PER_NODE).links) == MAX_LINKS_PER_NODE
    name = b"n" * (MAX_LINK_NAME_BYTES + 1)
    named = link + b"\x12" + varint(len(name)) + name
    with pytest.raises(DecodeError, match="name"):
        decode_node(b"\x12" + varint(len(named)) + named)


def test_decode_unixfs_bounds_sizes():
    with pytest.raises(DecodeError, match="blocksize"):
        decode_unixfs(b"\x08\x02\x20" + varint((1 << 62) + 1))
