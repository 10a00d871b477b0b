"""``p2ptrain ipfs cat|get|pin add`` fetch what the home's store lacks: through the home's running
node, or through a temporary node with ``--bootstrap`` (real node processes, the installed command)."""

import subprocess
import sys
from pathlib import Path

from p2ptrain.testing import node_processes, wait_for

P2PTRAIN = str(Path(sys.executable).with_name("p2ptrain"))
CONNECT_TIMEOUT_S = 30.0  # two node processes on loopback find each other in a few seconds


def ipfs(*args: str, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([P2PTRAIN, "ipfs", *args, "--home", str(home)], capture_output=True, timeout=90)


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

        fresh = tmp_path / "fresh"
        alone = ipfs("cat", cid, home=fresh)
        assert alone.returncode == 1 and "--bootstrap" in alone.stderr.decode()
        cat = ipfs("cat", cid, "--bootstrap", a.addr, home=fresh)
        assert cat.returncode == 0, cat.stderr
        assert cat.stdout == payload
