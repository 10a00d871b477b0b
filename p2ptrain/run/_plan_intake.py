"""The plans that reach a member: checked by the book, then followed, caught up to, held or reported.

Every plan of the task goes through :meth:`~p2ptrain.protocol.RoundBook.plan_problem`, also on a
peer that is not a member: it is how a joiner learns the roster whose votes elected the coordinator.
A plan this member may follow goes to the round loop (run/_spans.py), or, from a checkpoint it does
not hold, to the resync loop (run/_resync.py). A plan that names it from a sender its election does
not accept yet is held until the election settles it (protocol/_held_plans.py: a member that
advertised just after the election gets the first plan before a heartbeat); any other plan that
names it and that it will not follow is reported as CANNOT_FOLLOW at once, so the other members do
not wait for it until their start timeout.
"""

from __future__ import annotations

import logging

import trio
from libp2p.peer.id import ID

from p2ptrain.base import short_id
from p2ptrain.protocol import CANNOT_FOLLOW, HeldPlans, orphaned_stages, plan_order, RuleBreak, stage_moves
from p2ptrain.run._resync import Resync
from p2ptrain.run._run_state import RunState
from p2ptrain.run._spans import Spans
from p2ptrain.wire import RoundPlan

logger = logging.getLogger(__name__)

# How long a plan from a sender not yet accepted is held, in heartbeats: the next beat brings its
# certificate (a member follows it within one beat), one more allows for a beat lost or late.
HOLD_BEATS = 2


class PlanIntake:
    """What a member does with each plan it receives (see the module)."""

    def __init__(self, run: RunState, spans: Spans, resync: Resync) -> None:
        self.run = run
        self.spans = spans
        self.resync = resync
        self.held = HeldPlans(run.node.config.heartbeat_interval * HOLD_BEATS)

    async def on_plan(self, sender: str, plan: RoundPlan) -> None:
        """``plan`` from ``sender`` (see the module). One that names this member and does not follow
        on the last plan it took (one between them missed: protocol/_plans.py ``follows_on``) is
        counted as ``missed_plan`` and followed from the head: honest runs never count one."""
        run = self.run
        if run.book is None or run.trainer is None or plan.task_cid != run.task_cid:
            return
        book = run.book
        last = book.last_plan
        new = last is None or plan_order(plan) > plan_order(last)
        before, left_out = book.accepted, book.left_out_from
        term, coordinator = run.election.term, run.election.coordinator
        problem = book.plan_problem(plan, sender, run.election)
        if isinstance(problem, RuleBreak):
            run.refuse("plan_rules", f"refused plan {plan.round}.{plan.attempt} of {short_id(sender)}: {problem}")
            run.accuse(sender, problem)
            return
        if problem is not None:
            logger.debug("%s: not following plan %d.%d: %s", run.log_prefix, plan.round, plan.attempt, problem)
            if not new or run.me not in plan.members:
                return
            if HeldPlans.holds(plan, term, coordinator):  # (then the sender is the problem)
                # Its sender may be the coordinator whose certificate has not reached us yet: the
                # election settles it (settle), within HOLD_BEATS heartbeats.
                logger.info("%s: holding plan %d.%d of %s until the election of term %d settles", run.log_prefix,
                            plan.round, plan.attempt, short_id(sender), plan.term)
                for dropped in self.held.hold(trio.current_time(), sender, plan):
                    await self._cannot_follow(dropped.plan, f"{problem} (more plans held than {self.held.limit})")
                return
            # Listed in a plan we will not follow: the others would wait for us until their start timeout.
            await run.report_failure(plan, 0, f"{CANNOT_FOLLOW}: {problem}")
            return
        if last is not None and left_out is None and book.left_out_from is not None:  # follows_on: honest runs never
            run.refuse("missed_plan", f"plan {plan.term}/{plan.round}.{plan.attempt} does not follow on plan "
                       f"{last.term}/{last.round}.{last.attempt}, the last taken: a plan between them was missed")
        self._follow(sender, plan, before)

    async def settle(self) -> None:
        """After the election moved (a message, a tick): the held plans whose sender it now accepts
        go through :meth:`on_plan` again (checked like any plan); those it cannot are reported."""
        run = self.run
        if not len(self.held):
            return
        ready, given_up = self.held.settle(trio.current_time(), run.election.term, run.election.coordinator)
        for held in given_up:
            await self._cannot_follow(held.plan, f"plan from {short_id(held.sender)} in term {held.plan.term}: its "
                                      f"sender not accepted as coordinator of that term within {self.held.hold_s:g} s")
        for held in ready:
            logger.info("%s: %s is coordinator of term %d: following its plan %d.%d held", run.log_prefix,
                        short_id(held.sender), held.plan.term, held.plan.round, held.plan.attempt)
            await self.on_plan(held.sender, held.plan)

    async def _cannot_follow(self, plan: RoundPlan, why: str) -> None:
        """Report a held plan given up, unless a later plan was followed meanwhile."""
        run = self.run
        last = run.book.last_plan if run.book is not None else None
        if run.trainer is not None and (last is None or plan_order(plan) > plan_order(last)):
            await run.report_failure(plan, 0, f"{CANNOT_FOLLOW}: {why}")

    def _follow(self, sender: str, plan: RoundPlan, before: RoundPlan | None) -> None:
        run = self.run
        trainer, book = run.require()
        self._note_recovery(before, plan)
        # Only members of a plan we follow may open round channels to us before the round opens.
        run.collective.hub.expect(ID.from_base58(member) for member in plan.members)
        # A pipelined plan that goes back to our confirmed head (a stage lost every replica) is
        # followed from here: the span drops what this member holds and loads its stage (run/_spans.py).
        dropped = book.holds_dropped(plan, trainer.step)  # steps the run redid without us: not built on
        book.left_out_from = None  # this plan names us: decided here, once
        if not run.synced or dropped or not (trainer.can_align(plan.step) or book.rewinds(plan, trainer.step)):
            # Listed in a plan from a checkpoint we do not hold (a joiner from a head the run has left, a member
            # behind): the resync loop loads it by CID, then follows the plan; the others wait for our channels.
            if dropped:  # not the run's state: the resync loads the confirmed one (run/_resync.py)
                logger.warning("%s: at step %d, past steps the run redid without us: resyncing", run.log_prefix, trainer.step)
                run.mark_stale(trainer.step, trio.current_time())
            elif run.synced:
                run.desync(trio.current_time())
            self.spans.stop_rounds()
            self.resync.catch_up(sender, plan)
            return
        self.spans.follow(plan)

    def _note_recovery(self, before: RoundPlan | None, plan: RoundPlan) -> None:
        """A followed plan that fills a stage whose replicas all left (``before``'s assignment), from
        the last confirmed checkpoint: say so in the log and in ``task status`` (stage_recovery)."""
        run = self.run
        orphaned = orphaned_stages(before, plan.members)
        if not orphaned or run.trainer is None:
            return
        moves = stage_moves(before, plan)
        redone = max(0, run.trainer.step - plan.step)
        run.stage_recovery = {"stages": list(orphaned), "moved": [{"peer": m, "from": a, "to": b} for m, a, b in moves],
                              "step": plan.step, "version": plan.version, "redone": redone}
        logger.warning("%s: stage %s lost every replica; %s; the run goes back to model v%d (step %d), %d step%s "
                       "redone", run.log_prefix, ", ".join(map(str, orphaned)),
                       ", ".join(f"{short_id(m)} moves from stage {a} to {b}" for m, a, b in moves)
                       or "no member moves", plan.version, plan.step, redone, "" if redone == 1 else "s")
