"""Start p2ptrain processes from a template that has already imported torch, libp2p and p2ptrain.

A ``p2ptrain node start`` or a member script spends 3-4 s of CPU importing torch, libp2p and the
package before its first line of work; a test suite that starts hundreds of them spends most of its
time there. :func:`start_forked` asks a fork server (one per test process, started on first use,
which imported all of that once) to ``fork()`` a child that runs the command: a real, separate OS
process with its own pid, stdio, working directory and environment, that can be signalled and
SIGKILLed like any other, whose code from ``main(argv)`` on is the code the command runs. Only the
imports are shared, as ``multiprocessing``'s forkserver shares them.

A command behind ``ip netns exec NS`` is forked too, and the child enters that network namespace
itself. What cannot run that way is started by ``subprocess.Popen`` as before, unchanged: another
program or interpreter, ``python -c`` (tests that look at what a fresh interpreter imported),
another launcher (``env PYTHONPATH=...``), or an environment whose import-time variables
(``PYTHONPATH``, thread pools, malloc) differ from the server's. What a fork cannot give: each child shares the server's string
hash seed, where fresh interpreters each draw their own.

It is on where ``P2PTRAIN_TEST_FORK=1`` (the project's tests/conftest.py sets it unless it is set:
``P2PTRAIN_TEST_FORK=0 make test`` turns it off); elsewhere every command goes through
``subprocess.Popen``, so a benchmark that times a node's start-up still times a fresh process::

    proc = start_forked([sys.executable, "-m", "p2ptrain.cli.main", "node", "start", ...], stdout=log)
    proc.kill(); proc.wait(10)
    done = run_forked([P2PTRAIN, "model", "eval", ...], capture_output=True, text=True, timeout=60)
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import select
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from p2ptrain.node import NodeProcess as _NodeProcess
# The control socket's bound and the shared server's folder, spelled once where the workers'
# launcher (which imports nothing of the package) can read them too.
from p2ptrain.testing._forked_python import MAX_REQUEST as MAX_REQUEST, SHARE_ENV as SHARE_ENV

__all__ = ["ForkedProcess", "NodeProcess", "run_forked", "start_forked"]

# Environment variables read when the interpreter or a native library starts (import path, hash
# seed, thread pools, malloc, devices): a child whose values differ from the server's must start fresh.
IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "CUDA",
                        "TORCH", "PYTORCH", "NUMEXPR", "ATEN_")
# ... but for those torch sets in a running process at its first compile (inductor's cache folder,
# Intel OpenMP's duplicate-library switch) and reads only then, from os.environ, which the child
# takes whole: told apart, a test process that compiled once (or imported what does) stopped forking
# for the rest of its run, silently.
SET_AT_RUN_TIME = ("TORCHINDUCTOR_", "KMP_DUPLICATE_LIB_OK")
# Bound on the server's start (its imports: ~10 s of CPU on a loaded 2-core machine) and on one fork.
SERVER_START_TIMEOUT_S = 180.0
FORK_TIMEOUT_S = 30.0
# How long the test process, at its exit, waits for the server to see its children end.
SERVER_STOP_WAIT_S = 10.0
# The shared server's output, in its folder.
SERVER_LOG = "server.log"
# Where ``ip netns add`` names its network namespaces.
NETNS_DIR = Path("/run/netns")

_File = int | IO[Any] | None


def _wanted() -> bool:
    return os.environ.get("P2PTRAIN_TEST_FORK") == "1" and sys.platform == "linux"


def _import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) and not k.startswith(SET_AT_RUN_TIME)}


def _netns(args: Sequence[str]) -> tuple[str | None, Sequence[str]]:
    """The network namespace an ``ip netns exec NS`` prefix names (None without one), and the rest."""
    if len(args) > 4 and list(args[:3]) == ["ip", "netns", "exec"] and os.path.exists(NETNS_DIR / args[3]):
        return args[3], args[4:]
    return None, args


def _target(args: Sequence[str], cwd: str) -> tuple[str, str, list[str], str] | None:
    """(kind, target, sys.argv, sys.path[0]) of a command the server can run, as the interpreter
    would set them up: ``python -m MODULE ARGS``, ``python SCRIPT ARGS`` or a console script of this
    interpreter (``.venv/bin/p2ptrain ARGS``); None for anything else."""
    if not args:
        return None
    python = os.path.abspath(sys.executable)
    if os.path.abspath(args[0]) == python and len(args) >= 2:
        if args[1] == "-m" and len(args) >= 3 and not args[2].startswith("-"):
            return "module", args[2], [args[2], *args[3:]], cwd
        script = os.path.join(cwd, args[1])
        if not args[1].startswith("-") and os.path.isfile(script):
            return "path", args[1], list(args[1:]), os.path.dirname(os.path.realpath(script))
        return None
    exe = os.path.join(cwd, args[0])
    try:
        with open(exe, "rb") as f:
            first = f.readline(4096)
    except OSError:
        return None
    if first.rstrip(b"\r\n") == b"#!" + os.fsencode(python):
        return "path", args[0], list(args), os.path.dirname(os.path.realpath(exe))
    return None


class ForkedProcess:
    """A child of the fork server, driven as a ``subprocess.Popen`` (the part tests use): ``pid``,
    ``returncode``, ``poll``, ``wait``, ``communicate``, signals, and ``stdin``/``stdout``/``stderr``
    where PIPE was asked for. Its exit status comes from the server, its parent."""

    def __init__(self, args: Sequence[str], pid: int, status: socket.socket,
                 pipes: tuple[IO[Any] | None, IO[Any] | None, IO[Any] | None]) -> None:
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self.stdin, self.stdout, self.stderr = pipes
        self._status = status
        self._lock = threading.Lock()

    def _read_status(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        try:
            ready, _, _ = select.select([self._status], [], [], timeout)
        except (ValueError, OSError):  # another thread read the status and closed the socket
            ready = [self._status]
        if not ready:
            return
        with self._lock:
            if self.returncode is not None:
                return
            data = self._status.recv(64)
            self._status.close()
            # No status: the server itself died (it reaps its children, so the child is gone too).
            self.returncode = int(data) if data else -signal.SIGKILL

    def poll(self) -> int | None:
        self._read_status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read_status(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Read stdout and stderr (those that are pipes) to their end, then wait; as Popen's, bounded
        by ``timeout`` (TimeoutExpired). ``input`` is not supported (no test writes to a child)."""
        if input is not None:
            raise NotImplementedError("ForkedProcess.communicate: input")
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = [s for s in (self.stdout, self.stderr) if s is not None]
        chunks: dict[int, list[bytes]] = {s.fileno(): [] for s in streams}
        open_fds = set(chunks)
        while open_fds:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            ready, _, _ = select.select(list(open_fds), [], [], left)
            for fd in ready:
                data = os.read(fd, 1 << 16)
                if data:
                    chunks[fd].append(data)
                else:
                    open_fds.discard(fd)
        out = [self._decoded(s, b"".join(chunks[s.fileno()])) if s is not None else None
               for s in (self.stdout, self.stderr)]
        for s in streams:
            s.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return out[0], out[1]

    @staticmethod
    def _decoded(stream: IO[Any], data: bytes) -> Any:
        if isinstance(stream, io.TextIOBase):
            return data.decode(stream.encoding or "utf-8", errors=stream.errors or "strict").replace("\r\n", "\n")
        return data

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for s in (self.stdin, self.stdout, self.stderr):
            if s is not None:
                s.close()
        self.wait()


class _Server:
    """The fork server this process asks: its control socket, and a lock so that threads take turns.
    Its own child, or, where ``P2PTRAIN_TEST_FORK_SHARE`` names a folder (tests/conftest.py sets it
    for xdist's workers), one server that every process of the test run connects to: the first to
    ask starts it (a lock in the folder), so a ``-n 4`` run pays its imports once, not four times."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.owner = os.getpid()
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        errors = tempfile.TemporaryFile()  # noqa: SIM115 (the server's own output: none expected but a failed start)
        shared = os.environ.get(SHARE_ENV)
        self.folder = Path(shared) if shared else None  # a shared server's: its log lives there
        if self.folder is not None:
            self.sock = self._shared(self.folder)
        else:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self.proc = self._start(theirs, errors, listen=False)
            self.sock = ours
        ready, _, _ = select.select([self.sock], [], [], SERVER_START_TIMEOUT_S)
        hello = self.sock.recv(MAX_REQUEST) if ready else b""
        if hello != b"ready":
            if self.proc is not None:
                self.proc.kill()
                self.proc.wait()
            errors.seek(0)
            said = errors.read()[-4000:].decode(errors="replace") if self.folder is None else self._output()
            raise RuntimeError(f"the fork server did not start:\n{said}")
        errors.close()

    def _start(self, passed: socket.socket, errors: IO[bytes], *, listen: bool) -> subprocess.Popen[bytes]:
        """The server's process, handed ``passed`` (its control socket, or with ``listen`` the
        socket it accepts its askers on)."""
        args = [sys.executable, "-m", "p2ptrain.testing._zygote", *(["--listen"] if listen else []),
                str(passed.fileno())]
        proc = subprocess.Popen(args, pass_fds=[passed.fileno()], stdin=subprocess.DEVNULL, stdout=errors,
                                stderr=errors, env=self.env)
        passed.close()
        return proc

    def _shared(self, folder: Path) -> socket.socket:
        """A control socket connected to the test run's shared server, started here if none listens."""
        import fcntl

        path = str(folder / "control")
        with open(folder / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.connect(path)
                return sock
            except (FileNotFoundError, ConnectionRefusedError):
                pass
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a server that ended: its last asker had left
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            listener.bind(path)
            listener.listen(16)
            # Its output in the folder, not in this asker's temporary file: it outlives this asker,
            # and what it printed if it ever died is what the others' errors then quote.
            with open(folder / SERVER_LOG, "ab") as log:
                self._start(listener, log, listen=True)  # not waited for: it outlives the asker that started it
            sock.connect(path)  # held in the backlog until the server has imported everything
            return sock

    def fork(self, request: dict[str, Any], fds: list[int]) -> int:
        with self.lock:
            try:
                socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
                ready, _, _ = select.select([self.sock], [], [], FORK_TIMEOUT_S)
                reply = self.sock.recv(MAX_REQUEST) if ready else b""
            except OSError as exc:
                raise RuntimeError(f"the fork server is gone ({exc!r}); it printed:\n{self._output()}") from None
        if not reply:
            raise RuntimeError(f"the fork server did not answer; it printed:\n{self._output()}")
        answer = json.loads(reply)
        if "error" in answer:
            raise RuntimeError(f"the fork server could not fork: {answer['error']}")
        return int(answer["pid"])

    def _output(self) -> str:
        """The end of what a shared server printed (its log in the folder): why it stopped, where."""
        try:
            return (self.folder / SERVER_LOG).read_bytes()[-4000:].decode(errors="replace") if self.folder else ""
        except OSError:
            return ""

    def close(self) -> None:
        """The server sees this asker's end; its own server waits for its children and exits (waited
        for here, a while), a shared one once its last asker has left."""
        self.sock.close()
        if self.proc is not None:
            try:
                self.proc.wait(SERVER_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                pass


_server: _Server | None = None
_server_lock = threading.Lock()


def _the_server() -> _Server:
    global _server
    with _server_lock:
        if _server is None or _server.owner != os.getpid():
            _server = _Server()
            atexit.register(_server.close)
        return _server


def forked_worker_python() -> str | None:
    """The ``python=`` of a pytest-xdist ``popen`` spec whose workers are forked from this test
    run's shared fork server (:mod:`p2ptrain.testing._forked_python`), which is started now; None
    where forking is off or no shared server is set up (``P2PTRAIN_TEST_FORK_SHARE``)."""
    if not _wanted() or not os.environ.get(SHARE_ENV):
        return None
    _the_server()  # the workers ask it as they start: it must listen (and have imported) by then
    return shlex.join([sys.executable, str(Path(__file__).with_name("_forked_python.py"))])


def _fd(spec: _File, default: int, pipes: list[int], ours: list[IO[Any] | None], index: int,
        text: bool) -> int:
    """The descriptor a child gets for one of its stdio streams (a pipe's far end, kept in
    ``pipes`` to close once sent), as Popen reads ``stdin=``/``stdout=``/``stderr=``."""
    if spec is None:
        return default
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        pipes.append(fd)
        return fd
    if spec == subprocess.PIPE:
        read, write = os.pipe()
        near, far = (write, read) if index == 0 else (read, write)
        mode = "w" if index == 0 else "r"
        ours[index] = open(near, mode, encoding="utf-8") if text else open(near, mode + "b")  # noqa: SIM115
        pipes.append(far)
        return far
    if isinstance(spec, int):
        return spec
    return spec.fileno()


def start_forked(args: Sequence[str], *, stdin: _File = None, stdout: _File = None, stderr: _File = None,
                 cwd: str | Path | None = None, env: Mapping[str, str] | None = None, text: bool = False,
                 ) -> ForkedProcess | subprocess.Popen[Any]:
    """``subprocess.Popen(args, ...)`` through the fork server where it can run ``args``
    (a :class:`ForkedProcess`), else ``subprocess.Popen`` itself. ``stderr=subprocess.STDOUT`` and
    ``PIPE``/``DEVNULL``/files/descriptors are read as Popen does."""
    env = dict(os.environ if env is None else env)
    cwd = os.path.abspath(cwd if cwd is not None else os.getcwd())
    netns, command = _netns(args)
    target = _target(command, cwd) if _wanted() else None
    server = _the_server() if target is not None else None
    if target is None or server is None or _import_time_env(env) != _import_time_env(server.env):
        return subprocess.Popen(list(args), stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd, env=env, text=text)
    kind, path, argv, path0 = target
    pipes: list[int] = []
    ours: list[IO[Any] | None] = [None, None, None]
    status_ours, status_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        in_fd = _fd(stdin, 0, pipes, ours, 0, text)
        out_fd = _fd(stdout, 1, pipes, ours, 1, text)
        err_fd = out_fd if stderr == subprocess.STDOUT else _fd(stderr, 2, pipes, ours, 2, text)
        request = {"kind": kind, "target": path, "argv": argv, "path0": path0, "cwd": cwd, "env": env, "netns": netns}
        pid = server.fork(request, [in_fd, out_fd, err_fd, status_theirs.fileno()])
    except BaseException:
        status_ours.close()
        for f in ours:
            if f is not None:
                f.close()
        raise
    finally:
        status_theirs.close()
        for fd in pipes:
            os.close(fd)
    return ForkedProcess(args, pid, status_ours, (ours[0], ours[1], ours[2]))


def run_forked(args: Sequence[str], *, capture_output: bool = False, stdout: _File = None, stderr: _File = None,
               text: bool = False, timeout: float | None = None, check: bool = False, cwd: str | Path | None = None,
               env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` through :func:`start_forked`: on ``timeout`` the child is killed and
    TimeoutExpired raised; with ``check``, a non-zero exit raises CalledProcessError."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    proc = start_forked(args, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, cwd=cwd, env=env, text=text)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    code = proc.returncode
    assert code is not None
    if check and code:
        raise subprocess.CalledProcessError(code, list(args), out, err)
    return subprocess.CompletedProcess(list(args), code, out, err)


class NodeProcess(_NodeProcess):
    """:class:`p2ptrain.node.NodeProcess` started through :func:`start_forked`: where the fork server
    is on, the same ``p2ptrain node start`` command line, a separate process to kill or restart,
    without its seconds of imports (in a network namespace too, behind ``ip netns exec NS``)."""

    popen = staticmethod(start_forked)
