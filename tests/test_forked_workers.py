"""xdist's workers forked from the test run's fork server (p2ptrain/testing/_forked_python.py): the
launcher runs ``python -u -c CODE`` as a forked child with its own stdio, passes signals on and
exits with the child's status; anything else runs a fresh interpreter."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2ptrain.testing import _forkserver

# The child reads a line and answers with it, whether torch was there before it ran (it was forked
# from the server), and its parent's pid; then exits 3.
ECHO = ("import sys, os; line = sys.stdin.readline().strip(); "
        "print(line, 'torch' in sys.modules, os.getppid(), flush=True); sys.exit(3)")
SLEEPER = "import time, sys; print('up', flush=True); time.sleep(60); sys.exit(0)"


@pytest.fixture
def worker_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The launcher's command line, asking a shared fork server: this run's (under xdist), else one
    started for the test in its own folder."""
    monkeypatch.setenv("P2PTRAIN_TEST_FORK", "1")
    if os.environ.get(_forkserver.SHARE_ENV):
        python = _forkserver.forked_worker_python()
        assert python is not None
        yield shlex.split(python)
        return
    monkeypatch.setenv(_forkserver.SHARE_ENV, str(tmp_path))
    monkeypatch.setattr(_forkserver, "_server", None)
    python = _forkserver.forked_worker_python()
    assert python is not None
    try:
        yield shlex.split(python)
    finally:
        assert _forkserver._server is not None
        _forkserver._server.close()


def test_a_worker_is_forked_with_its_stdio_and_its_exit_status(worker_python: list[str]) -> None:
    done = subprocess.run([*worker_python, "-u", "-c", ECHO], input="hello\n", capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3, done.stderr
    line, had_torch, parent = done.stdout.split()
    assert line == "hello" and had_torch == "True"
    assert "_zygote" in Path(f"/proc/{parent}/cmdline").read_text(), "not a child of the fork server"


def test_a_signal_to_the_launcher_reaches_the_worker(worker_python: list[str]) -> None:
    proc = subprocess.Popen([*worker_python, "-u", "-c", SLEEPER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()


def test_askers_that_die_mid_request_cost_the_shared_server_nothing(worker_python: list[str]) -> None:
    """Askers leave without warning (a launcher killed while it waits for its answer); the server
    the whole run shares serves the next one. (Once a shared server died mid-run and took three
    tests' forks with it.) One asker leaves before its greeting is read, one right after its request:
    that child still runs and its status still comes; then a worker is forked as ever."""
    control = str(Path(os.environ[_forkserver.SHARE_ENV]) / "control")
    gone = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    gone.connect(control)
    gone.close()
    asker = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    asker.settimeout(60)
    asker.connect(control)
    assert asker.recv(64) == b"ready"
    status, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    request = {"kind": "code", "target": "import sys; sys.exit(7)", "argv": ["-c"], "path0": "",
               "cwd": os.getcwd(), "env": dict(os.environ), "netns": None}
    with open(os.devnull, "r+b") as null:
        socket.send_fds(asker, [json.dumps(request).encode()], [null.fileno()] * 3 + [theirs.fileno()])
    theirs.close()
    asker.close()
    status.settimeout(60)
    assert status.recv(64) == b"7"
    status.close()
    done = subprocess.run([*worker_python, "-u", "-c", ECHO], input="again\n", capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3 and done.stdout.split()[0] == "again", done.stderr


def test_another_command_line_runs_a_fresh_interpreter(worker_python: list[str]) -> None:
    done = subprocess.run([*worker_python, "-c", "import sys; print('torch' in sys.modules)", "extra"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
    done = subprocess.run([*worker_python, "--version"], capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith("Python 3.")


def test_this_suites_workers_are_forked() -> None:
    """Under ``make test`` (xdist, forking on) this very process is a child of the fork server."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("P2PTRAIN_TEST_FORK") != "1":
        pytest.skip("not an xdist worker with forking on (make test runs this one)")
    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
    assert b"p2ptrain.testing._zygote" in parent, parent
    assert sys.argv[0] == "-c"
