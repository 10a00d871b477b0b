"""The Kubo backend against a real IPFS RPC daemon (js-ipfs from npm, started by ipfs/start-jsipfs.sh).

No Kubo binary installs from the registries this project reaches; js-ipfs serves the same RPC API.
The daemon is started once per session on 127.0.0.1 with no bootstrap peers. These tests skip only
when node/npm are missing; `make test` installs js-ipfs first.
"""

from __future__ import annotations

import io
import os
import select
import signal
import subprocess
import time
from pathlib import Path

import ipfshttpclient
import pytest

from p2ptrain.cli.main import main as cli_main
from p2ptrain.base import UserError, command_line_words
from p2ptrain.ipfs import ContentStore, ContentUnavailable, EmbeddedStore, open_store
from p2ptrain.ipfs._kubo import KuboStore, api_multiaddr

# The first test may install js-ipfs (~4 min) when `make test` has not already: allow for it.
# Every test but the unreachable-daemon one talks to js-ipfs: they need node and npm (tests/conftest.py).
# Under `pytest -n N` the file's tests run on one worker (tests/conftest.py, ONE_WORKER_FILES), so
# the session's daemon starts once.
pytestmark = pytest.mark.timeout(900)
NEEDS_JSIPFS = pytest.mark.needs("node", "npm")

IPFS_DIR = Path(__file__).resolve().parents[2] / "ipfs"
START_TIMEOUT = 180

# ../shared/FIELD-NOTES.md: content = bytes(i % 251 for i in range(n)); (n, CIDv0, CIDv1 raw leaves)
VECTORS = [
    (b"hello world\n", "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o",
     "bafkreifjjcie6lypi6ny7amxnfftagclbuxndqonfipmb64f2km2devei4"),
    (0, "QmbFMke1KXqnYyBBWxB74N4c5SBnJMVAiMNRcGu6x1AwQH",
     "bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku"),
    (1, "QmS9JArPwa55ePgDnyg6TzX24mYTS1b1vLqWNebyVotKxQ",
     "bafkreidogqfzz75tpkmjzjke425xqcrmpcib2p5tg44hnbirumdbpl5adu"),
    (262145, "QmUSjGawaz4ptvREcMKSMJneWCa5j8dAz2wSAAvHtW2rnB",
     "bafybeiexg2oqkfnj56l7fcmawswqbijt5shq4b5rg6a546uwpkqqzwjioi"),
    (1048576, "QmXgkY4miMKJBrg8YYke4xw6C2n8WNsUc1GXLhN84k4QM3",
     "bafybeiedpcapwld4tkgtzwahfofgn4wex5ryysf4se6hwpmlrsh4ntnrau"),
    (45613057, "QmTedsTekQQkgACJXb1sPZSW8bLdS9LPMrT7L4YdjNRd4n",
     "bafybeib4y7ghw2rq7bracc4xwtxrbzo7cfvagdpte2tmrkgwl6dyard3cm"),
]


def vector_bytes(spec: bytes | int) -> bytes:
    if isinstance(spec, bytes):
        return spec
    pattern = bytes(range(251))
    return (pattern * (spec // 251 + 1))[:spec]


@pytest.fixture(scope="session")
def kubo_api(tmp_path_factory) -> str:
    """The RPC API URL of a js-ipfs daemon on 127.0.0.1, running for the whole session."""
    subprocess.run([str(IPFS_DIR / "install-jsipfs.sh")], check=True, timeout=900)  # no-op once done
    repo = tmp_path_factory.mktemp("jsipfs") / "repo"
    proc = subprocess.Popen(
        [str(IPFS_DIR / "start-jsipfs.sh"), str(repo)],
        env={**os.environ, "JSIPFS_API_PORT": "0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        url = _wait_for_api(proc, time.monotonic() + START_TIMEOUT)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the script stops its daemon on TERM
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_for_api(proc: subprocess.Popen, deadline: float) -> str:
    seen = []
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"start-jsipfs.sh exited before the API was up: {''.join(seen)}")
        seen.append(line)
        if line.startswith("API "):
            return line.split()[1]
    pytest.fail(f"no js-ipfs API within {START_TIMEOUT} s: {''.join(seen)}")


@pytest.fixture
def kubo(kubo_api) -> KuboStore:
    return KuboStore(kubo_api)


@NEEDS_JSIPFS
def test_open_store_picks_kubo_for_an_api_url(kubo_api, tmp_path):
    store = open_store(tmp_path, kubo_api)
    assert isinstance(store, KuboStore) and isinstance(store, ContentStore)


@pytest.mark.parametrize("spec,cid0,cid1", VECTORS, ids=lambda v: str(v)[:12])
@NEEDS_JSIPFS
def test_identical_cids_on_both_backends(kubo, tmp_path, spec, cid0, cid1):
    data = vector_bytes(spec)
    embedded = EmbeddedStore(tmp_path)
    assert kubo.add_bytes(data) == embedded.add_bytes(data) == cid0
    assert kubo.add_bytes(data, cid_version=1) == embedded.add_bytes(data, cid_version=1) == cid1
    assert kubo.add_bytes(data, only_hash=True) == cid0


@NEEDS_JSIPFS
def test_cat_and_get_return_verified_bytes(kubo, tmp_path):
    data = os.urandom(700_000)
    cid = kubo.add_bytes(data, cid_version=1)
    assert kubo.cat(cid) == data
    kubo.get(cid, tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == data
    assert kubo.has(cid)
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]  # no temporary file left behind


@NEEDS_JSIPFS
def test_content_with_another_layout_is_verified_block_by_block(kubo_api, kubo, tmp_path):
    """Content someone added with a non-default chunker cannot be recomputed; it is still checked."""
    data = os.urandom(50_000)
    raw = ipfshttpclient.Client(api_multiaddr(kubo_api))
    cid = raw.add(io.BytesIO(data), chunker="size-4096", pin=False)["Hash"]
    assert kubo.cat(cid) == data
    kubo.get(cid, tmp_path / "small-chunks")
    assert (tmp_path / "small-chunks").read_bytes() == data


@NEEDS_JSIPFS
def test_pins(kubo):
    data = os.urandom(10_000)
    cid = kubo.add_bytes(data)  # Kubo's add pins, as `ipfs add` does
    assert kubo.pin_ls()[cid] == "recursive"
    kubo.pin_rm(cid)
    assert cid not in kubo.pin_ls()
    with pytest.raises(ContentUnavailable, match="not pinned"):
        kubo.pin_rm(cid)
    kubo.pin_add(cid, recursive=False)
    assert kubo.pin_ls()[cid] == "direct"
    kubo.pin_rm(cid)


def test_unreachable_daemon_is_one_clear_error():
    with pytest.raises(UserError, match="cannot reach the IPFS RPC API at http://127.0.0.1:9"):
        KuboStore("http://127.0.0.1:9", timeout=5).add_bytes(b"x")
    # One message, worded for its caller: the keyword to a script, the flag on the command line.
    with pytest.raises(UserError, match="^ipfs_api=: expected an RPC API address") as bad:
        KuboStore("ftp://example")
    assert command_line_words(bad.value).startswith("--ipfs: expected an RPC API address"), command_line_words(bad.value)


@NEEDS_JSIPFS
def test_cli_add_and_cat_through_kubo(kubo_api, tmp_path, capsys):
    path = tmp_path / "hello.txt"
    path.write_bytes(b"hello world\n")
    assert cli_main(["ipfs", "add", str(path), "--ipfs", kubo_api]) == 0
    assert capsys.readouterr().out.strip() == "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
    assert cli_main(["ipfs", "cat", "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o", "--ipfs", kubo_api]) == 0
    assert capsys.readouterr().out == "hello world\n"


@NEEDS_JSIPFS
def test_cli_ipfs_flag_before_the_subcommand(kubo_api, tmp_path, capsys):
    cid = KuboStore(kubo_api).add_bytes(b"flag first\n")
    assert cli_main(["ipfs", "--ipfs", kubo_api, "cat", cid]) == 0
    assert capsys.readouterr().out == "flag first\n"
    # Without --ipfs anywhere the home's embedded store is used, which does not hold it (and no
    # node runs for the home to fetch it).
    assert cli_main(["ipfs", "cat", cid, "--home", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert cid in err and "no node is running" in err
