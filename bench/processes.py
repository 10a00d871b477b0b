"""Members as separate processes: the parent-worker protocol bench/allreduce.py and
bench/robust_wan.py share (imported by path: bench/ is not a package).

The parent starts one worker process per member (:func:`run_workers`, each by a ``launch`` that may
wrap its argv, e.g. in a network namespace: bench/wan.py, bench/robust_wan.py). Each worker listens,
prints ``ADDR <multiaddr>/p2p/<id>`` and reads every member's address as one JSON line on stdin
(:func:`join`), dials the members after it, does its rounds and prints ``RESULT <json>``
(:func:`result`); the parent collects the last RESULT of each, in member order.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

Launch = Callable[[int, list[str]], list[str]]  # (member, its argv) -> what to run


def same_machine(i: int, argv: list[str]) -> list[str]:
    """How member ``i``'s worker is started: as is."""
    return argv


def run_workers(count: int, argv_of: Callable[[int], list[str]], launch: Launch = same_machine, *,
                timeout: float) -> list[dict]:
    """Start ``count`` workers (``launch(i, argv_of(i))``), give each every member's address, and
    return each one's RESULT; SystemExit if one fails to start or to report."""
    procs = [subprocess.Popen(launch(i, argv_of(i)), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for i in range(count)]
    try:
        addrs = []
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.startswith("ADDR "):
                raise SystemExit(f"a member process failed to start: {line!r}")
            addrs.append(line.split()[1])
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(addrs) + "\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                raise SystemExit(f"a member process failed (exit {proc.returncode})")
            results.append(json.loads(lines[-1][7:]))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


async def join(host: Any, me: int, *, timeout: float = 120.0, attempts: int = 5) -> list[Any]:
    """In a worker whose ``host`` runs and whose handlers are registered: announce our address, read
    every member's, dial the members after us (a loaded machine can time out a handshake: up to
    ``attempts`` tries each) and return the ring (every member's peer ID, in member order)."""
    import trio
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr

    print(f"ADDR {host.get_addrs()[0]}/p2p/{host.get_id().to_base58()}", flush=True)
    infos = [info_from_p2p_addr(Multiaddr(a)) for a in json.loads(await trio.to_thread.run_sync(sys.stdin.readline))]
    for info in infos:  # so a round can (re)dial any member, whoever dialled first
        host.get_peerstore().add_addrs(info.peer_id, info.addrs, 3600)

    async def connect(info: Any) -> None:
        for attempt in range(attempts):
            try:
                await host.connect(info)
                return
            except Exception:
                if attempt == attempts - 1:
                    raise
                await trio.sleep(0.5)

    with trio.fail_after(timeout):
        async with trio.open_nursery() as nursery:
            for info in infos[me + 1 :]:
                nursery.start_soon(connect, info)
    return [info.peer_id for info in infos]


def result(report: object) -> None:
    """A worker's report to the parent (the last such line counts)."""
    print("RESULT " + json.dumps(report), flush=True)
