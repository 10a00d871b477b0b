"""Leaving a pipelined step at once when a member of its plan says it takes no part in it, and a span's
checkpoint gather when a member reports the span's last round failed: the runtime
of :class:`~p2ptrain.protocol.StepAborts` (which reports count, and why leaving is safe only until
the step's summary opens here, is that module's docstring).

A member leaves by cancelling its part of the step (its drive, or its wait at the summary's join),
then tells the plan's other members so with the collective's abort notice on the summary's round,
naming the member that takes no part: one that the report has not reached yet (gossip keeps no
order between senders) then fails that round at once naming the same member, instead of blaming the
member that left when it finds its channels gone. The step fails here as :class:`PeerFailed` naming
it: the run's usual round failure (run/_spans.py) leaves it out of plans for the quarantine, and the
coordinator's retry goes on without it.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import trio
from libp2p.peer.id import ID

from p2ptrain.collective import PeerFailed
from p2ptrain.protocol import StepAborts
from p2ptrain.run._run_state import RunState
from p2ptrain.wire import RoundFailed, RoundPlan

# How long a member still waits at a span's checkpoint gather for a member that reported the span's
# last round failed: an honest one never joins it (it holds the step before); one whose report was
# false and that sent its statement after all joins within moments of the others.
CHECKPOINT_GRACE_S = 3.0


class StepWindow:
    """One member's pipelined steps, each one it may still leave, step after step, plan after plan."""

    def __init__(self, run: RunState) -> None:
        self.run = run
        self._aborts = StepAborts(run.me)
        self._scope: trio.CancelScope | None = None  # the step's, while it runs
        self._culprit: str | None = None  # the member this member left that step for
        self._graced = False  # whether the body is a checkpoint gather (left after CHECKPOINT_GRACE_S)

    def on_report(self, plan: RoundPlan | None, reporter: str, report: RoundFailed) -> None:
        """A signed failure report while this member follows ``plan``: leave the step now when its
        sender, a member of the plan, said it takes no part in it and this member still may."""
        culprit = self._aborts.report(plan, reporter, report)
        if culprit is not None and self._scope is not None:
            self._culprit = culprit
            self._leave()

    def _leave(self) -> None:
        """Leave the step now, or the checkpoint gather if its reporter has not joined it by the grace."""
        assert self._scope is not None
        if self._graced:
            self._scope.deadline = min(self._scope.deadline, trio.current_time() + CHECKPOINT_GRACE_S)
        else:
            self._scope.cancel()

    def joined(self) -> None:
        """Every member joined the step's summary or checkpoint gather here (before this member sends
        anything in it): no report ends it any more (Collective.gather's ``joined``)."""
        self._aborts.close()
        if self._graced and self._scope is not None:
            self._scope.deadline = math.inf  # (the reporter joined after all: the gather goes on)

    @contextmanager
    def _leavable(self, culprit: str | None, *, graced: bool) -> Iterator[trio.CancelScope]:
        """The scope of a body this member leaves for ``culprit`` (known already, or named by a report
        while it runs: :meth:`on_report`), at once or, ``graced``, CHECKPOINT_GRACE_S later."""
        self._culprit, self._graced = culprit, graced
        with trio.CancelScope() as scope:
            self._scope = scope
            if culprit is not None:
                self._leave()
            try:
                yield scope
            finally:
                self._scope, self._graced = None, False

    @asynccontextmanager
    async def open(self, plan: RoundPlan, index: int, summary_id: int) -> AsyncIterator[None]:
        """The step of round ``index`` of ``plan`` (its summary's round ``summary_id``) as a body this
        member leaves when a member of the plan says it takes no part in it, already or until the
        summary opens (:meth:`joined`): then the others are told and :class:`PeerFailed` names it."""
        with self._leavable(self._aborts.begin(plan, index), graced=False) as scope:
            yield
        if not scope.cancelled_caught or self._culprit is None:  # only this module cancels the scope
            return
        culprit = ID.from_base58(self._culprit)
        reason = f"said it takes no part in round {plan.round + index} (attempt {plan.attempt})"
        ring = [ID.from_base58(m) for m in plan.members]
        await self.run.collective.hub.broadcast_abort(ring, summary_id, culprit, reason, tell_culprit=False)
        raise PeerFailed(culprit, reason)

    @asynccontextmanager
    async def checkpoint(self, plan: RoundPlan) -> AsyncIterator[None]:
        """The checkpoint gather at the end of ``plan``'s span as a body this member leaves when a member
        of the plan reports the span's last round failed, already or until every member joined the
        gather (:meth:`joined`), and has not joined it CHECKPOINT_GRACE_S later: its statement never
        comes, so no member completes the gather, and waiting out its start timeout only delayed
        the retry (:class:`PeerFailed` names it). The grace keeps a false report from ending a
        checkpoint whose reporter sent its statement after all (protocol/_failure_reports.py judges
        it once the record is confirmed)."""
        try:
            with self._leavable(self._aborts.begin_checkpoint(plan), graced=True) as scope:
                yield
        finally:
            self._aborts.close()
        if scope.cancelled_caught and self._culprit is not None:
            raise PeerFailed(ID.from_base58(self._culprit),
                             f"reported round {plan.round + plan.rounds - 1} (attempt {plan.attempt}) failed: "
                             "its stage statement will not come")
