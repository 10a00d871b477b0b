"""Who takes part in an election: its settings, the candidate order, who counts as alive, whose votes elect.

Pure, like :mod:`p2ptrain.protocol._election`: the node hands in a :class:`View` of what it sees of
its peers (the mesh's heartbeats, who advertises the task, who a round found unreachable, which
connections are open) and :func:`voters_alive` turns it into the set the election votes among. The
rules live here, not in the node, so the election simulator runs them too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from p2ptrain.base import short_id
from p2ptrain.protocol import signing
from p2ptrain.protocol._records import quorum
from p2ptrain.protocol.signing import SignatureError
from p2ptrain.wire import CoordinatorBeat


@dataclass(frozen=True)
class ElectionConfig:
    heartbeat_s: float = 1.0
    # A coordinator silent for this many heartbeats is presumed dead; also how long a term may pass
    # without electing anyone before the next term starts.
    timeout_beats: int = 3
    # A coordinator silent for this many heartbeats *and* to which we hold no connection is presumed
    # dead already (discovery keeps a connection to every peer it knows, and members talk directly):
    # a coordinator that died between rounds otherwise cost the full timeout (3 s). 1.5 beats: one
    # beat late is jitter, half a beat more with no connection is a dead process.
    unconnected_silent_beats: float = 1.5

    @property
    def timeout_s(self) -> float:
        return self.heartbeat_s * self.timeout_beats


@dataclass(frozen=True)
class View:
    """What a member sees of its peers at one tick of the election."""

    # Peers whose mesh heartbeats we hear (alive on the network, whatever their state).
    heard: frozenset[str] = frozenset()
    # Peers that advertise the task (they hold the state the run is at) and meet its requirements.
    advertising: frozenset[str] = frozenset()
    # Peers a round found unreachable (a broken channel, a refused dial), until their quarantine
    # ends: dead at once, not when the mesh stops hearing them (5 s) or beats stop (3 s).
    gone: frozenset[str] = frozenset()
    # Peers we hold an open connection to; None when the node cannot tell (then the
    # ``unconnected_silent_beats`` rule is off).
    connected: frozenset[str] | None = None


def voters_alive(
    view: View,
    roster: Sequence[str],
    me: str,
    *,
    coordinator: str | None,
    heard_at: float,
    now: float,
    config: ElectionConfig,
) -> frozenset[str]:
    """Who counts as alive for the election: the roster's peers that the mesh hears, plus the peers
    that advertise the task, plus ourselves; less the peers a round found gone, and less our
    coordinator when it missed ``unconnected_silent_beats`` heartbeats and we hold no connection to
    it (only while both hold: a connection that comes back, or a beat, makes it live again).

    A roster member that is resyncing (heard, not advertising) is still a voter, or the coordinator
    would step down each time one member catches up.
    """
    gone = set(view.gone)
    if (
        coordinator is not None and coordinator != me and view.connected is not None
        and now - heard_at > config.unconnected_silent_beats * config.heartbeat_s
        and coordinator not in view.connected
    ):
        gone.add(coordinator)
    return frozenset(((view.heard & set(roster)) | view.advertising | {me}) - gone)


def rank(task_cid: str, term: int, peer: str) -> bytes:
    """A peer's place in the candidate order of a term (lowest first); fresh order every term."""
    return hashlib.sha256(f"{task_cid}\x00{term}\x00{peer}".encode()).digest()


def designated(task_cid: str, term: int, candidates: Collection[str]) -> str | None:
    """The one peer that should stand in ``term``: the lowest rank among ``candidates``."""
    return min(candidates, key=lambda p: rank(task_cid, term, p), default=None)


def certificate_problem(task_cid: str, beat: CoordinatorBeat, voters: Collection[str]) -> str | None:
    """Why ``beat``'s votes do not elect its coordinator under the roster ``voters``, or None if they
    do: a quorum of distinct roster members' valid signatures for this task, term and coordinator."""
    voters = set(voters)
    seen: set[str] = set()
    for signed in beat.votes:
        v = signed.vote
        if (v.task_cid, v.term, v.candidate) != (task_cid, beat.term, beat.coordinator):
            return f"a vote in the certificate is for another election ({v.term}, {short_id(v.candidate)})"
        if v.voter in seen or v.voter not in voters:
            continue
        try:
            signing.verify(v, v.voter, signed.signature)
        except SignatureError as exc:
            return str(exc)
        seen.add(v.voter)
    if len(seen) < quorum(len(voters)):
        return f"{len(seen)} valid roster votes, a quorum is {quorum(len(voters))}"
    return None
