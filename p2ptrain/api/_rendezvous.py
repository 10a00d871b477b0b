"""Members that start the same script find one run by its name, and only a run of the same model.

A run of the user's own module is a task like any other (its bytes stored by CID, announced on the
tasks topic), but nobody publishes it ahead: every member that starts the script makes the task it
would publish (the run's name, the CID of its architecture card, the options, the CID of its own
initial weights) and announces it. Each member then takes, among the tasks of that name it heard
within a short window (:data:`JOIN_WINDOW_S`), a run already under way if there is one (a member
of it is heard of), else the task with the lowest CID: members that hear each other pick the same one, so a run never splits in
two of the same name; the initial weights of the task taken are loaded into every member's module,
so all start from the same bits. A task whose architecture card differs from this member's refuses
it, in one line that names the first tensor or option that differs (:mod:`p2ptrain.models._fingerprint`).
A run heard of whose task cannot be had (its members gone with its bytes) is skipped, and the
member listens on for the rest of its window: it once took its own task at once instead, beside a
run of the same name under way.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import trio
from torch import nn

from p2ptrain.base import UserError
from p2ptrain.ipfs import ContentUnavailable
from p2ptrain.services import KnownTask, Peer
from p2ptrain.models import CardError, MAX_CARD_BYTES, card_from_bytes, file_bytes_bound, first_difference
from p2ptrain.protocol import load_model_bytes, model_bytes
from p2ptrain.task import MAX_TASK_BYTES, Task, TaskError, task_bytes, task_from_bytes
from p2ptrain.wire import TASKS_TOPIC, TaskAnnounce

log = logging.getLogger(__name__)

# How long a member listens for the tasks of its run's name before it takes one: others that start
# the script at about the same time announce theirs within it (an announcement a second each).
JOIN_WINDOW_S = 5.0
ANNOUNCE_EVERY_S = 1.0
# A member of a run goes on announcing it this often, so that a member who starts the script later
# (a late joiner) hears of the run within its window; one small message per member per period.
KEEP_ANNOUNCING_S = 2.0
# With bootstrap addresses, the window starts once one of them is connected, within this.
CONNECT_TIMEOUT_S = 60.0
# Each candidate task and architecture card is fetched within this (bounded in bytes as well).
FETCH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Chosen:
    """The run this member takes part in: its task, and whether it is this member's own."""

    task_cid: str
    task: Task
    own: bool


async def store_own(peer: Peer, task: Task, card: bytes, module: nn.Module, user_card: Mapping[str, Any]) -> str:
    """Store (and pin) this member's architecture card, its initial weights and its task; its CID.
    ``task`` names the card and the weights already (their CIDs are computed the same way)."""
    store = peer.content.store

    def put() -> str:
        for data in (card, model_bytes(module, user_card)):
            store.pin_add(store.add_bytes(data))
        cid = store.add_bytes(task_bytes(task))
        store.pin_add(cid)
        return str(cid)

    return await trio.to_thread.run_sync(put)


async def choose_run(peer: Peer, name: str, own_cid: str, card: dict[str, object], window: float = JOIN_WINDOW_S,
                     *, expect_peers: bool = False, allow: frozenset[str] | None = None) -> Chosen:
    """Announce ``own_cid`` as a run named ``name`` for ``window`` seconds, then take the run of that
    name (see the module); :class:`UserError` naming the difference when it is not this model's.
    ``expect_peers`` (bootstrap addresses were given): the window starts once a peer is connected,
    within :data:`CONNECT_TIMEOUT_S`, so a slow dial does not make a run of one. ``allow`` (an
    allowlisted run): only tasks announced by those peers are candidates, so a stranger's task of the
    same name is never taken (its initial weights never loaded)."""
    tasks = peer.tasks
    if expect_peers:
        with trio.move_on_after(CONNECT_TIMEOUT_S):
            # py-libp2p has no event for a new connection: poll.
            while not (peer.node.host and peer.node.host.get_connected_peers()):  # noqa: ASYNC110
                await trio.sleep(0.1)
        if not (peer.node.host and peer.node.host.get_connected_peers()):
            raise UserError(f"run {name!r}: no bootstrap peer answered within {CONNECT_TIMEOUT_S:.0f} s")
    deadline = trio.current_time() + window
    skipped: set[str] = set()  # runs announced that could not be had: a stale one is not the end of the window
    while True:
        await peer.node.publish(TASKS_TOPIC, TaskAnnounce(task_cid=own_cid, name=name))
        for cid in sorted(set(_under_way(peer, name, allow)) - skipped):
            if cid == own_cid:  # others took this member's task already
                return Chosen(own_cid, await _task(peer, own_cid), True)
            chosen = await _take(peer, cid, name, card)
            if chosen is not None:
                return chosen
            skipped.add(cid)
        if trio.current_time() >= deadline:
            break
        await trio.sleep(min(ANNOUNCE_EVERY_S, max(0.0, deadline - trio.current_time())))
    heard = sorted(cid for cid, known in tasks.known.items()
                   if _candidate(known, name, allow) and cid != own_cid and cid not in skipped)
    for cid in sorted([own_cid, *heard]):
        if cid == own_cid:
            break
        chosen = await _take(peer, cid, name, card)
        if chosen is not None:
            return chosen
    return Chosen(own_cid, await _task(peer, own_cid), True)


async def _take(peer: Peer, cid: str, name: str, card: dict[str, object]) -> Chosen | None:
    """The run of task ``cid`` if it is one of this model (:class:`UserError` naming the difference
    if it is another's); None if it cannot be had (its task is gone with its members, or is not a
    run of the user's module of that name): the caller listens on for another."""
    try:
        task = await _task(peer, cid)
    except (ContentUnavailable, TaskError) as exc:
        log.warning("run %s: the task %s someone announced for it cannot be had (%s); skipped", name, cid, exc)
        return None
    if not task.model.user or task.name != name:
        return None  # not a run of this kind (a task of the registry's models of the same name)
    difference = first_difference(await _card(peer, task), card)
    if difference is not None:
        raise UserError(f"run {name!r} ({cid}) trains another model or with other options: {difference}")
    return Chosen(cid, task, False)


async def keep_announcing(peer: Peer, name: str, task_cid: str) -> None:
    """Announce the run this member takes part in every :data:`KEEP_ANNOUNCING_S` (until cancelled)."""
    while True:
        await peer.node.publish(TASKS_TOPIC, TaskAnnounce(task_cid=task_cid, name=name))
        await trio.sleep(KEEP_ANNOUNCING_S)


def _candidate(known: KnownTask, name: str, allow: frozenset[str] | None) -> bool:
    """A task heard of that may be this run: its name, and, in an allowlisted run, announced by a
    member the list names."""
    return known.name == name and (allow is None or known.announced_by in allow)


def _under_way(peer: Peer, name: str, allow: frozenset[str] | None) -> list[str]:
    """Candidate tasks whose run has started: a head heard that names members, or a peer whose
    heartbeats say it holds the run's state. The second is what a first member waiting for
    ``min_peers`` shows (it has no head with members yet): without it a member starting after that
    one's window closed took the lowest CID, its own half the time, and the two waited apart."""
    joined = {cid for record in peer.node.membership.alive()
              if allow is None or record.peer_id.to_base58() in allow for cid in record.tasks}
    return [cid for cid, known in peer.tasks.known.items()
            if _candidate(known, name, allow) and (known.head is not None and known.head.members or cid in joined)]


async def _task(peer: Peer, cid: str) -> Task:
    await peer.content.fetch(cid, timeout=FETCH_TIMEOUT_S, max_bytes=MAX_TASK_BYTES)
    data = await trio.to_thread.run_sync(lambda: peer.content.store.cat(cid, max_bytes=MAX_TASK_BYTES + 1))
    return task_from_bytes(data)


async def _card(peer: Peer, task: Task) -> dict[str, object]:
    cid = task.model.architecture
    assert cid is not None
    try:
        await peer.content.fetch(cid, timeout=FETCH_TIMEOUT_S, max_bytes=MAX_CARD_BYTES)
        data = await trio.to_thread.run_sync(lambda: peer.content.store.cat(cid, max_bytes=MAX_CARD_BYTES + 1))
        return card_from_bytes(data)
    except (ContentUnavailable, CardError) as exc:
        raise UserError(f"run {task.name!r}: its architecture card {cid} cannot be read: {exc}") from None


async def load_initial(peer: Peer, task: Task, module: nn.Module) -> None:
    """The run's initial weights (another member's, by CID) into this member's module, fetched and
    read within what a file of this module's tensors takes (issue 27: no model bomb)."""
    cid = task.initial_model
    assert cid is not None
    data = await peer.content.read(cid, max_bytes=file_bytes_bound(module.state_dict().values()),
                                   timeout=FETCH_TIMEOUT_S)
    await trio.to_thread.run_sync(load_model_bytes, module, data)
