"""``p2ptrain ipfs …`` through the installed command, as a user runs it."""

import sys
from pathlib import Path

import pytest

from p2ptrain.testing import run_forked

P2PTRAIN = str(Path(sys.executable).with_name("p2ptrain"))
HELLO_V0 = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
HELLO_V1 = "bafkreifjjcie6lypi6ny7amxnfftagclbuxndqonfipmb64f2km2devei4"


def run(*args, home):
    return run_forked(
        [P2PTRAIN, "ipfs", *args, "--home", str(home)], capture_output=True, timeout=60
    )


@pytest.fixture
def hello(tmp_path):
    path = tmp_path / "hello.txt"
    path.write_bytes(b"hello world\n")
    return path


def test_add_cat_get(tmp_path, hello):
    home = tmp_path / "home"
    added = run("add", str(hello), home=home)
    assert added.returncode == 0, added.stderr
    assert added.stdout.decode().strip() == HELLO_V0
    assert run("cat", HELLO_V0, home=home).stdout == b"hello world\n"
    out = tmp_path / "copy.txt"
    got = run("get", HELLO_V0, "-o", str(out), home=home)
    assert got.returncode == 0, got.stderr
    assert out.read_bytes() == b"hello world\n"


def test_only_hash_and_cid_version_1_store_nothing(tmp_path, hello):
    home = tmp_path / "home"
    added = run("add", "--only-hash", "--cid-version", "1", str(hello), home=home)
    assert added.stdout.decode().strip() == HELLO_V1
    missing = run("cat", HELLO_V1, home=home)
    assert missing.returncode == 1
    assert HELLO_V1 in missing.stderr.decode()


def test_pins_persist(tmp_path, hello):
    home = tmp_path / "home"
    run("add", str(hello), home=home)
    assert run("pin", "add", HELLO_V0, home=home).returncode == 0
    assert run("pin", "ls", home=home).stdout.decode() == f"{HELLO_V0} recursive\n"
    assert run("pin", "rm", HELLO_V0, home=home).returncode == 0
    assert run("pin", "ls", home=home).stdout == b""


@pytest.mark.parametrize(
    "args,message",
    [
        (("get", HELLO_V0, "-o", "/nonexistent/dir/x"), "no such directory"),
        (("pin", "rm", HELLO_V0), "not pinned"),
        (("add", "/nonexistent-file"), "not a file"),
    ],
)
def test_user_errors_are_one_line(tmp_path, args, message):
    result = run(*args, home=tmp_path / "home")
    err = result.stderr.decode()
    assert result.returncode == 1
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_progress_bar_only_for_a_terminal_or_a_large_file(capsys):
    from p2ptrain.cli.ipfs import LARGE_FILE, progress_bar

    with progress_bar("add", 1000) as progress:  # stderr is captured: not a terminal
        assert progress is None
    with progress_bar("add", LARGE_FILE) as progress:
        progress(LARGE_FILE // 2)
    assert "add" in capsys.readouterr().err


def test_get_into_a_folder(tmp_path, hello):
    home = tmp_path / "home"
    run("add", str(hello), home=home)
    folder = tmp_path / "out"
    folder.mkdir()
    assert run("get", HELLO_V0, "-o", str(folder), home=home).returncode == 0
    assert (folder / HELLO_V0).read_bytes() == b"hello world\n"


def test_add_pins_recursively_unless_pin_false(tmp_path, hello):
    """As Kubo's ipfs add: pinned (so repo gc keeps it) unless --pin=false, Kubo's spelling."""
    home = tmp_path / "home"
    unpinned = run("add", "--pin=false", str(hello), home=home)
    assert unpinned.returncode == 0, unpinned.stderr
    assert run("pin", "ls", home=home).stdout == b""
    assert run("cat", HELLO_V0, home=home).stdout == b"hello world\n"  # stored, only not pinned
    assert run("add", str(hello), home=home).returncode == 0
    assert run("pin", "ls", home=home).stdout.decode() == f"{HELLO_V0} recursive\n"
    bad = run("add", "--pin=maybe", str(hello), home=home)
    assert bad.returncode == 2 and "true or false" in bad.stderr.decode()


def test_a_fetch_off_a_terminal_says_how_far_it_is_on_stderr_only(capsys, monkeypatch):
    """While the home's node fetches, a log sees a line every PROGRESS_LINE_S (0 here: every call);
    stdout stays the content's, for ipfs cat."""
    from p2ptrain.services import _fetching

    monkeypatch.setattr(_fetching, "PROGRESS_LINE_S", 0.0)
    with _fetching.fetch_progress("fetch QmX") as show:  # stderr is captured: not a terminal
        show(3 * 2**20)
    out, err = capsys.readouterr()
    assert out == "" and err == "fetch QmX: 3.0 MiB so far\n"
