"""The ``python`` that pytest-xdist starts its workers with, when they are forked from the fork server.

execnet starts a worker as ``PYTHON -u -c BOOTSTRAP`` and speaks to it over its stdin and stdout.
Started fresh, each of a ``-n 6`` run's workers imports torch, libp2p, scikit-learn and the package
again before it collects: ~6 CPU-s a worker, on two cores while the six collect together. Given
``--tx 6*popen//python="PYTHON THIS_FILE"`` (tests/conftest.py does), execnet runs this script
instead: a bare interpreter that imports only the standard library, so it starts in milliseconds.
It asks the test run's fork server (``$P2PTRAIN_TEST_FORK_SHARE/control``, which the controller
started) to fork a child that runs BOOTSTRAP with this process's stdin, stdout and stderr, passes
on the signals it gets, and exits with the child's status. A command line it does not expect, or
no server to ask, runs a fresh interpreter instead, as the line would have.

It runs as a file, not as ``-m p2ptrain.testing...``: importing the package would cost what it
saves. So the two names of the server's socket live here, in a module of the standard library only,
and :mod:`p2ptrain.testing._forkserver` imports them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from typing import NoReturn

# A folder (set by tests/conftest.py for xdist's workers) where one fork server for the whole test
# run listens (``control``) and the first process to ask starts it (``lock``).
SHARE_ENV = "P2PTRAIN_TEST_FORK_SHARE"
# Bound on one request or reply on the control socket (an environment and an argv: a few KiB).
MAX_REQUEST = 1 << 20
# Bound on the server's greeting and its answer (it forks at once; a loaded machine, a few seconds).
ANSWER_TIMEOUT_S = 60.0


def _fresh(args: list[str]) -> NoReturn:
    os.execv(sys.executable, [sys.executable, *args])


def main(args: list[str]) -> NoReturn:
    """Run ``python ARGS`` as a forked child where ARGS is ``[-u] -c CODE``, else fresh."""
    share = os.environ.get(SHARE_ENV)
    if len(args) < 2 or args[-2] != "-c" or any(a != "-u" for a in args[:-2]) or not share:
        _fresh(args)
    control = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        control.connect(os.path.join(share, "control"))
    except OSError:  # no server listens (the controller did not start one): start fresh
        control.close()
        _fresh(args)
    control.settimeout(ANSWER_TIMEOUT_S)
    if control.recv(64) != b"ready":
        sys.exit("the fork server did not greet this worker")
    # A signal that comes before the child's pid is known waits, and is passed on once it is.
    passed = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    signal.pthread_sigmask(signal.SIG_BLOCK, passed)
    status, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    request = {"kind": "code", "target": args[-1], "argv": ["-c"], "path0": "", "cwd": os.getcwd(),
               "env": dict(os.environ), "netns": None}
    socket.send_fds(control, [json.dumps(request).encode()], [0, 1, 2, theirs.fileno()])
    theirs.close()
    answer = json.loads(control.recv(MAX_REQUEST) or b"{}")
    control.close()
    if "pid" not in answer:
        sys.exit(f"the fork server could not fork this worker: {answer.get('error', 'no answer')}")
    pid = int(answer["pid"])

    def pass_on(signum: int, _frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in passed:
        signal.signal(signum, pass_on)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, passed)
    data = status.recv(64)  # the child's exit status, once the server has reaped it
    code = int(data) if data else -signal.SIGKILL  # no status: the server died, and its children with it
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main(sys.argv[1:])
