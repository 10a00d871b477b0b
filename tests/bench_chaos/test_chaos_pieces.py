"""The chaos bench's own pieces (bench/hostile.py, bench/chaos.py), checked on real bytes.

The bench is only as good as its attacker and its verdicts: these tests check that the hostile
peer's messages are real, signed frames an honest node accepts (so a node that survives them
survived the attack, not a typo), that the attack payloads are what issue 13 describes, and that
the block check the bench runs after each scenario does find a corrupted block. The whole bench
(real node processes, minutes) is not run here: `python bench/chaos.py --quick` does that.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from p2ptrain.ipfs import EmbeddedStore, cid_str, decode_node, parse_cid
from p2ptrain.ipfs._cid import verify_block
from p2ptrain.wire import Kind, MESH_TOPIC, _codec as codec, parse_header
from p2ptrain.testing import local_mesh

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    """bench/NAME.py by path (bench/ is scripts, not a package); chaos.py imports hostile by name."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


hostile = _load("hostile")
chaos = _load("chaos")


async def test_hostile_heartbeats_are_accepted_frames_from_its_own_and_from_fresh_identities(tmp_path: Path) -> None:
    async with local_mesh(1, tmp_path) as (node,), hostile.hostile_peer() as peer:
        with trio.fail_after(60):
            target = await peer.connect(str(node.addrs[0]))
            await peer.wait_in_topic(MESH_TOPIC, [target])
            sent = await hostile.flood(peer, seconds=0.2, rate=50)
            fresh = [create_new_key_pair() for _ in range(3)]
            for key_pair in fresh:
                await peer.publish_as(key_pair, MESH_TOPIC, hostile.fresh_heartbeat(key_pair, 1))
            want = {peer.peer_id} | {ID.from_pubkey(k.public_key) for k in fresh}
            while not want <= {p.peer_id for p in node.membership.alive()}:
                await trio.sleep(0.05)
        assert sent["messages"] >= 1
        assert node.router.delivered["heartbeat"] >= sent["messages"] + len(fresh)
        assert not node.router.dropped, node.router.dropped
        record = node.membership.get(ID.from_pubkey(fresh[0].public_key))
        assert len(record.addrs) == hostile.FRESH_ADDRS


def test_ts_overflow_message_is_correctly_signed_and_carries_10_to_the_400() -> None:
    peer = hostile.HostilePeer.__new__(hostile.HostilePeer)  # signing needs only the key and a seq
    peer.key_pair, peer._seq = create_new_key_pair(), 0
    peer.host = type("H", (), {"get_addrs": lambda self: ["/ip4/127.0.0.1/tcp/1"]})()
    data = hostile.ts_overflow_message(peer)
    _, _, length = struct.unpack_from(">4sBI", data)
    head_and_payload = data[: 9 + length]
    assert json.loads(head_and_payload[9:])["ts"] == 10**400
    assert peer.key_pair.public_key.verify(codec._DOMAIN + head_and_payload, data[9 + length :])


def test_dag_bomb_is_three_levels_of_174_links_to_one_child_and_every_block_hashes_to_its_cid() -> None:
    blocks = hostile.dag_bomb()
    assert len(blocks) == hostile.BOMB_LEVELS + 1
    for cid, data in blocks:
        verify_block(cid, data)
    for (_, parent), (child_cid, _) in zip(blocks, blocks[1:]):
        links = decode_node(parent).links
        assert len(links) == hostile.BOMB_FANOUT and {bytes(link.cid) for link in links} == {bytes(child_cid)}
    assert sum(len(data) for _, data in blocks) < 30_000  # "a 23 KB DAG"
    cid, data = hostile.empty_dagpb_block()
    assert data == b"" and cid_str(cid) == "QmdfTbBqBPQ7VNxZEYEj14VmRuZBkqFbiwReogJgS1zR1n"


def test_hello_frame_is_a_collective_hello() -> None:
    frame = hostile.hello_frame(7)
    header = parse_header(frame)
    assert header.kind == Kind.HELLO and header.round_id == 7 and len(frame) == 24 + 32


def test_block_check_counts_a_corrupted_block(tmp_path: Path) -> None:
    store = EmbeddedStore(tmp_path)
    store.add_bytes(b"one block" * 1000)
    root = parse_cid(store.add_bytes(b"another" * 1000))
    assert chaos.corrupted_blocks([tmp_path]) == 0
    path = next(p for p in (tmp_path / "blocks").glob("??/*.data") if p.read_bytes() == store.block(root))
    path.write_bytes(b"flipped" + path.read_bytes()[7:])
    assert chaos.corrupted_blocks([tmp_path]) == 1
