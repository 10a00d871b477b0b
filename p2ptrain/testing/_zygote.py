"""The fork server's own process (``python -m p2ptrain.testing._zygote FD``): it imports torch,
libp2p and every p2ptrain module once, then forks one child per request that arrives on its control
socket (:mod:`p2ptrain.testing._forkserver` is the side that asks). A child becomes the command it
was asked for (stdio, working directory, environment, argv, network namespace) and exits as the
interpreter would; the server reaps it and sends its exit status to the asker. It exits once the
asker's end of the control socket closes and its last child has ended. A child whose environment
has ``P2PTRAIN_TEST_QUICK_TIMERS=1`` shortens the protocol's idle waits first (p2ptrain/testing/_timers.py).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import signal
import socket
import sys
import threading
import types
from typing import Any

import trio

from p2ptrain.testing._forkserver import MAX_REQUEST, NETNS_DIR
from p2ptrain.testing._timers import QUICK_ENV, apply_quick_timers, quick_timers_off

# What the server imports before it forks: what a node that trains, the CLI and the member scripts
# import (every p2ptrain module), the data sources the tests add datasets from, and transformers
# (AutoConfig and the Auto classes: the hf models of examples and tests; each xdist worker paid ~1.2 CPU-s).
PRELOAD_PACKAGES = ("p2ptrain",)
PRELOAD_MODULES = ("torch", "numpy", "libp2p", "trio", "safetensors.torch", "sklearn.datasets", "transformers.models.auto")
# Set once everything is frozen: trio's module-level Random, which hypothesis (a test worker's
# plugin) registers and warns about unless gc.get_referrers finds who holds it; among frozen objects
# (trio's module, which does) it finds none.
_visible_referrers: list[object] | None = None
# setns(2)'s flag for a network namespace.
CLONE_NEWNET = 0x40000000


def _preload() -> None:
    import importlib
    import pkgutil

    for name in PRELOAD_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    for package in PRELOAD_PACKAGES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if info.name == "p2ptrain.testing._zygote":  # this module, running as __main__
                continue
            try:
                importlib.import_module(info.name)
            except ImportError:  # an optional extra not installed (torchvision): its users import it fresh
                pass
    # torch's lazy imports (torch._dynamo, on the first optimizer), which every node and member that
    # trains pays once: 1.8 CPU-s a child forked cold, 0.2 warm (imports only: no thread starts).
    from p2ptrain.training import warm_up_torch

    warm_up_torch()


def _name_process(request: dict[str, Any]) -> None:
    """Name the child in ``ps``/``top`` for its command (``p2ptrain``, ``member_script.py``), not
    for the server its argv still reads as."""
    target, kind = request["target"], request["kind"]
    name = target.split(".")[0] if kind == "module" else "python" if kind == "code" else os.path.basename(target)
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:
        pass


def _enter_netns(name: str) -> None:
    """Move this (single-threaded) child into network namespace ``name``, as ``ip netns exec``
    does for the command it runs: every socket it opens from now on is in that namespace."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _child(request: dict[str, Any], fds: list[int], inherited: list[int]) -> None:
    """In the forked child: become the command (its stdio, directory, environment, argv), run it,
    and exit as the interpreter would. Never returns."""
    import runpy

    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in inherited:
            os.close(fd)
        for target, fd in zip((0, 1, 2), fds[:3]):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        _name_process(request)
        if request.get("netns"):
            _enter_netns(request["netns"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if os.environ.get(QUICK_ENV) == "1" and not quick_timers_off():
            apply_quick_timers()  # this child's own modules: the server and its other children keep theirs
        sys.argv = list(request["argv"])
        sys.path[0] = request["path0"]
        if request["kind"] == "module":
            sys.modules.pop(request["target"], None)  # run as __main__, as `python -m` does, not the preloaded copy
            runpy.run_module(request["target"], run_name="__main__", alter_sys=True)
        elif request["kind"] == "code":  # `python -c CODE` (a test run's worker: _forked_python.py)
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            # The code of a local launcher (execnet's bootstrap line), never anything from the network.
            exec(compile(request["target"], "<string>", "exec"), main.__dict__)  # noqa: S102
        else:
            runpy.run_path(request["target"], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        try:
            threading._shutdown()  # type: ignore[attr-defined]  # what interpreter exit does first
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve(controls: list[socket.socket], listener: socket.socket | None) -> None:
    """Fork a child per request on any control socket; tell each requester its child's exit status
    when it is reaped. A ``listener`` (a fork server shared by a test run's processes) adds a
    control socket per connection, each greeted with ``ready``. Once the last control socket ends
    (and no connection waits on the listener), wait for the children still running, then return.

    An asker may die at any moment (a test killed, a launcher signalled): whatever fails on its
    socket ends that asker alone, never the server the rest of the run's processes share."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    statuses: dict[int, socket.socket] = {}
    while controls or statuses or listener is not None:
        watched = [wake_read, *(c.fileno() for c in controls), *([listener.fileno()] if listener else [])]
        ready, _, _ = select.select(watched, [], [], 1.0)
        if wake_read in ready:
            os.read(wake_read, 4096)
        _reap(statuses)
        if listener is not None and listener.fileno() in ready:
            _greet(listener, controls)
        for control in [c for c in controls if c.fileno() in ready]:
            try:
                data, fds, _, _ = socket.recv_fds(control, MAX_REQUEST, 4)
            except OSError:  # its asker is gone
                data, fds = b"", []
            if not data:
                for fd in fds:
                    os.close(fd)
                controls.remove(control)
                control.close()
                continue
            reply = _fork(data, fds, [wake_read, wake_write, *(c.fileno() for c in controls),
                                      *([listener.fileno()] if listener else []),
                                      *(s.fileno() for s in statuses.values())], statuses)
            try:
                control.send(reply)
            except OSError:  # the asker died waiting: its child runs on and is reaped as any
                controls.remove(control)
                control.close()
        if listener is not None and not controls and not _waiting(listener):
            listener.close()  # the last asker left: later ones start a server of their own
            listener = None


def _reap(statuses: dict[int, socket.socket]) -> None:
    """Reap the children that ended; send each one's exit status to its status socket."""
    while statuses:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock = statuses.pop(pid, None)
        if sock is not None:
            try:
                sock.sendall(str(os.waitstatus_to_exitcode(status)).encode())
            except OSError:  # nobody waits for it any more
                pass
            sock.close()


def _greet(listener: socket.socket, controls: list[socket.socket]) -> None:
    """Take the connection waiting on ``listener`` as an asker, greeted with ``ready``."""
    try:
        joined, _ = listener.accept()
    except OSError:  # it gave up before it was taken
        return
    try:
        joined.send(b"ready")
    except OSError:
        joined.close()
        return
    controls.append(joined)


def _fork(data: bytes, fds: list[int], inherited: list[int], statuses: dict[int, socket.socket]) -> bytes:
    """Fork the child a request asks for (its stdio ``fds[:3]``, its status socket ``fds[3]``);
    the reply to send: its pid, or the error that stopped it."""
    try:
        request = json.loads(data)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, fds, inherited)
        statuses[pid] = socket.socket(fileno=fds[3])
        reply: dict[str, Any] = {"pid": pid}
    except Exception as exc:  # a request it cannot serve: say so, serve the next
        reply = {"error": repr(exc)}
        for fd in fds[3:]:
            os.close(fd)
    for fd in fds[:3]:
        os.close(fd)
    return json.dumps(reply).encode()


def _waiting(listener: socket.socket) -> bool:
    """Whether a connection waits on ``listener`` (read without blocking)."""
    ready, _, _ = select.select([listener], [], [], 0)
    return bool(ready)


def main() -> None:
    """``FD``: the control socket of the one process that asks; ``--listen FD``: a listening socket
    that every process of a test run connects to (:mod:`p2ptrain.testing._forkserver`, shared)."""
    listening = sys.argv[1] == "--listen"
    first = socket.socket(fileno=int(sys.argv[2 if listening else 1]))
    _preload()
    # What was imported lives as long as any child: out of the collector's sight, a child's full
    # collections no longer walk the ~350k objects of torch, libp2p and the package (0.25 CPU-s
    # each), nor write to their pages, which a fork shares until written.
    gc.collect()
    gc.freeze()
    global _visible_referrers
    _visible_referrers = [trio._core._run._r]  # a list made now: not frozen
    sys.stdout.flush()
    if listening:
        _serve([], first)
    else:
        first.send(b"ready")
        _serve([first], None)


if __name__ == "__main__":
    main()
