"""A hostile *member* for the chaos bench: a real p2ptrain peer in the bench's process that joins a
run of real `node start` processes, trains, votes, takes part in robust rounds, and lies.

bench/hostile.py is a hostile libp2p peer: it signs what it likes but never joins a run. The attacks
of issue 27 that need a member (a coordinator that signs records of a model nobody trained; a
chunk's owner that writes values of its own into the chunk it reduces, or sends one member other
bytes for it) run the real runtime here (``services.make_peer``), with the attack's seams patched
by tests/collective/hostile.py, the module the in-process tests use (loaded by path: one copy of
each attack). The member's node runs inside its :class:`Owner`'s ``acting()`` block, so the
owner attack acts in every task of that peer and in no other peer of the process (a test may run
honest peers beside it); the owner is honest until an attack is switched on (``owner.poison``,
``owner.equivocate_to``) with :func:`attacks.installed` in effect.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from libp2p.crypto.keys import KeyPair

_spec = importlib.util.spec_from_file_location(
    "p2ptrain_bench_hostile_member", Path(__file__).resolve().parent.parent / "tests" / "collective" / "hostile.py")
attacks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(attacks)

JOIN_TIMEOUT_S = 120.0  # fetch the task, the data and the run's state from the mesh on a loaded machine
STOP_TIMEOUT_S = 15.0


@dataclass
class Member:
    peer: Any  # p2ptrain.services.Peer
    owner: Any  # attacks.Owner, honest until an attack is set on it


@asynccontextmanager
async def member(home: Path, bootstrap: list[str], key: KeyPair | None = None) -> AsyncIterator[Member]:
    """A full peer (node, content and task services) on ``home`` bootstrapping from ``bootstrap``
    (multiaddrs ending in /p2p/ID); with ``key``, that identity (:func:`attacks.ground_key`). Yields
    it and its owner attack once it hears every bootstrap peer (bounded by JOIN_TIMEOUT_S); stopped
    (goodbye sent) on exit."""
    from p2ptrain.node import Node, NodeConfig
    from p2ptrain.services import make_peer

    if key is not None:
        attacks.install_key(home, key)
    node = Node(home, NodeConfig(bootstrap=list(bootstrap), dht=False))
    peer = make_peer(node)
    owner = attacks.Owner(None)
    async with trio.open_nursery() as nursery:
        with owner.acting():  # every task of this peer's node inherits it
            await nursery.start(node.run)
        owner.collective = peer.tasks.collective  # its key signs what it equivocates
        try:
            others = {addr.rsplit("/p2p/", 1)[1] for addr in bootstrap}
            with trio.fail_after(JOIN_TIMEOUT_S):
                await node.membership.wait_until(
                    lambda membership: others <= {r.peer_id.to_base58() for r in membership.alive()})
            yield Member(peer, owner)
        finally:
            node.stop()
            with trio.move_on_after(STOP_TIMEOUT_S):
                await node.stopped.wait()
            nursery.cancel_scope.cancel()


async def join(hostile: Member, task_cid: str) -> Any:
    """Join the run and wait (bounded) until this member holds its state and advertises it: from
    then on the coordinator plans it and the election counts it. Returns its TaskRun."""
    with hostile.owner.acting():  # the run's tasks may be started from this one: they inherit it
        run = await hostile.peer.tasks.join(task_cid)
    with trio.fail_after(JOIN_TIMEOUT_S):
        while not run.shared.synced:
            await trio.sleep(0.2)
    return run
