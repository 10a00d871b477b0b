"""``p2ptrain ipfs cat|get|ls|stat|pin add`` fetch what the home's store lacks: through the home's
running node, or through a temporary node with ``--bootstrap`` (real node processes, the installed
command); and ``ipfs.progress``, which the CLI asks while the node fetches."""

import json
import os
import subprocess
import sys
from pathlib import Path

import trio

from p2ptrain.control import ops as control_ops
from p2ptrain.testing import local_peers, node_processes, run_forked, wait_for

P2PTRAIN = str(Path(sys.executable).with_name("p2ptrain"))
CONNECT_TIMEOUT_S = 30.0  # two node processes on loopback find each other in a few seconds
DEADLINE_S = 60.0  # the in-process test: two peers start and exchange about 1 MiB on loopback
CHUNK = 256 * 1024  # the importer's chunk: one leaf
FILE_BYTES = 4 * CHUNK + 123  # a root over five leaves
CLI_TIMEOUT_S = 90.0  # one command; the temporary node alone may take 20 s to reach a peer


def ipfs(*args: str, home: Path) -> subprocess.CompletedProcess:
    return run_forked([P2PTRAIN, "ipfs", *args, "--home", str(home)], capture_output=True, timeout=CLI_TIMEOUT_S)


def test_cat_get_pin_through_the_running_node_and_a_temporary_one(tmp_path):
    payload = bytes(range(256)) * 4096 + b"tail"  # 1 MiB + 4 bytes: several blocks under one root
    src = tmp_path / "payload.bin"
    src.write_bytes(payload)
    with node_processes(2, tmp_path / "nodes", extra_args=["--no-dht"]) as (a, b):
        added = ipfs("add", str(src), home=a.home)
        assert added.returncode == 0, added.stderr
        cid = added.stdout.decode().strip()
        wait_for(lambda: b.status()["peers"], CONNECT_TIMEOUT_S)

        cat = ipfs("cat", cid, home=b.home)
        assert cat.returncode == 0, cat.stderr
        assert cat.stdout == payload
        out = tmp_path / "got.bin"
        got = ipfs("get", cid, "-o", str(out), home=b.home)
        assert got.returncode == 0, got.stderr
        assert out.read_bytes() == payload
        pinned = ipfs("pin", "add", cid, home=b.home)
        assert pinned.returncode == 0, pinned.stderr
        assert ipfs("pin", "ls", home=b.home).stdout.decode() == f"{cid} recursive\n"
        other = tmp_path / "other.bin"  # one more, for ls and stat to fetch through the node
        other.write_bytes(os.urandom(len(payload)))  # 5 distinct leaves under one root
        other_cid = ipfs("add", "--cid-version", "1", str(other), home=a.home).stdout.decode().strip()
        stat = ipfs("stat", other_cid, "--json", home=b.home)
        assert stat.returncode == 0, stat.stderr
        assert json.loads(stat.stdout) | {"cumulative_size": 0} == {
            "cid": other_cid, "type": "file", "size": len(payload), "cumulative_size": 0, "blocks": 6, "links": 5}
        assert len(ipfs("ls", other_cid, home=b.home).stdout.splitlines()) == 5

        fresh = tmp_path / "fresh"
        alone = ipfs("cat", cid, home=fresh)
        assert alone.returncode == 1 and "--bootstrap" in alone.stderr.decode()
        cat = ipfs("cat", cid, "--bootstrap", a.addr, home=fresh)
        assert cat.returncode == 0, cat.stderr
        assert cat.stdout == payload


async def test_progress_of_a_fetch_in_flight_is_answered_by_the_control_op(tmp_path):
    """``ipfs.progress`` (what the CLI shows while the node fetches): the verified bytes so far of a
    fetch in flight, and nothing once it ended. Asked at every scheduling point of the node's own
    loop, so it is asked between the root block's arrival and the last leaf's, whatever the speed."""
    request = b""
    replies: list[dict] = []

    async def ask() -> dict:
        return await fetcher.node.control.handle_line(request)

    with trio.fail_after(DEADLINE_S):
        async with local_peers(2, tmp_path) as (holder, fetcher):
            cid = holder.content.store.add_bytes(os.urandom(FILE_BYTES))
            request = json.dumps({"op": control_ops.IPFS_PROGRESS, "cid": cid}).encode()
            assert await ask() == {"ok": True, "cid": cid, "fetching": False, "bytes": 0}
            done = trio.Event()

            async def fetch() -> None:
                await fetcher.content.fetch(cid, timeout=DEADLINE_S / 2)
                done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetch)
                while not done.is_set():
                    replies.append(await ask())
                    await trio.lowlevel.checkpoint()
            assert any(r["fetching"] and 0 < r["bytes"] < FILE_BYTES for r in replies), replies[-3:]
            assert await ask() == {"ok": True, "cid": cid, "fetching": False, "bytes": 0}


async def test_a_temporary_node_shows_how_far_its_fetch_is(tmp_path, capsys, monkeypatch):
    """``--bootstrap`` (a temporary node in the command's process, services/_fetching.py) says on stderr how
    far its fetch is, as a fetch through the home's node does: here a line per verified block
    (``PROGRESS_LINE_S`` = 0; 10 s off a terminal in use). Red before: the temporary node was silent."""
    from p2ptrain.services import _fetching, ensure_local

    monkeypatch.setattr(_fetching, "PROGRESS_LINE_S", 0.0)
    with trio.fail_after(DEADLINE_S):
        async with local_peers(1, tmp_path) as (holder,):
            cid = holder.content.store.add_bytes(os.urandom(FILE_BYTES))
            fresh = tmp_path / "fresh"
            await trio.to_thread.run_sync(ensure_local, fresh, [cid], holder.node.addrs[:1])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(f"fetch {cid[:16]}")]
    assert len(lines) >= 2 and lines[-1].endswith(f"{FILE_BYTES / 2**20:.1f} MiB so far"), lines
