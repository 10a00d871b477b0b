"""Which replica of a pipelined run is left out for altered activations: the drivers' word, weighed.

A driver that gets two different outputs for one FORWARD asks a third replica of the stage; to that
driver the replica outvoted is a liar (pipeline/_driver.py). That is one driver's observation, and
nothing another member can check: a hostile driver could name any honest replica. So a driver only
*accuses*: it puts the replicas it outvoted in its own signed entry of the step's summary
(run/_step_summary.py), which every member receives alike, and a replica is *convicted* when more
than half of the plan's drivers accuse it. One hostile driver among several therefore evicts nobody
on its own; a run with a single driver trusts that driver, which already chooses the step's data and
computes its stage 0 (docs/security.md, "Pipelined tasks"). A convicted replica is the culprit of the
step's failure, as a member a robust round proves :class:`~p2ptrain.collective.Misbehaved`: every
member's book leaves it out of plans for the quarantine, and the retry runs without it.

Also here: what a driver signs to get the key that draws its checked microbatches
(:func:`check_key_message`): a deterministic Ed25519 signature over the plan's base, which no
replica can compute before the microbatches reach it and which the driver does not choose.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from p2ptrain.base import StrikeWindows
from p2ptrain.wire import RoundPlan


def convicted(drivers: Sequence[str], accusations: Mapping[str, Collection[str]]) -> tuple[str, ...]:
    """The replicas accused by more than half of ``drivers``, sorted (every member computes the same).

    ``accusations``: driver -> the replicas it outvoted. Accusations by anyone but a driver, and of a
    driver (a driver is checked by nobody here), do not count; a driver accusing twice counts once.
    """
    voters = set(drivers)
    votes: dict[str, int] = {}
    for driver, accused in accusations.items():
        if driver not in voters:
            continue
        for replica in set(accused) - voters:
            votes[replica] = votes.get(replica, 0) + 1
    return tuple(sorted(r for r, n in votes.items() if 2 * n > len(voters)))


# A driver whose step failed while another driver's did not, in LONE_FAILURES of the last
# FAILURE_WINDOW summaries it was in that blamed anyone, is the step's culprit (LoneFailures).
LONE_FAILURES = 3
FAILURE_WINDOW = 10
MAX_DRIVERS_KEPT = 1024  # drivers whose record is kept (the oldest dropped first): plans change members


class LoneFailures:
    """Which driver fails a pipelined run's steps on its own, as every member reads the summaries.

    A driver's entry in the step summary says whether its step failed, and any failure drops the
    step on every member; that failure named nobody, so the retry kept the same members. One
    hostile driver saying "failed" in every entry stopped a run for good (0 steps in 100 s, never
    left out), and an honest driver whose every replica of a stage it distrusts failed every retry
    until the plans changed. A step that fails at every driver says nothing of who is to blame (a
    replica died: each driver misses its holdings). But a driver whose step fails while another
    driver's does not, in ``limit`` of the last ``window`` such summaries, is the culprit: the caller
    fails the step as :class:`~p2ptrain.collective.Misbehaved` naming it, so every book leaves it out
    for the quarantine, as a convicted replica. A window, not a streak: a driver that let every third
    step through would never complete a streak. A driver that caught a liar fails one step, then
    distrusts it and goes on. Pure: the caller hands in each summary's drivers and failures, in order.
    """

    def __init__(self, limit: int = LONE_FAILURES, window: int = FAILURE_WINDOW) -> None:
        self.limit, self.window = limit, window
        self._records = StrikeWindows(limit, window, MAX_DRIVERS_KEPT)  # driver -> its last summaries: failed alone

    def observe(self, drivers: Sequence[str], failed: Collection[str]) -> str | None:
        """One step's summary: the driver now to blame (the first in ``drivers``' order), or None."""
        if all(d in failed for d in drivers):
            return None  # every driver failed (or none drove): nobody is singled out
        culprit = None
        for driver in drivers:
            if self._records.note(driver, driver in failed) and culprit is None:
                culprit = driver
        if culprit is not None:
            self._records.forget(culprit)  # back after its quarantine with a clean record
        return culprit


def check_key_message(plan: RoundPlan) -> bytes:
    """What a driver of ``plan`` signs with its peer key to get the key of its checked-microbatch draw
    (:func:`p2ptrain.pipeline.is_checked`). Its parts are fixed before the span: the task and the
    plan's base (the last confirmed model) and the span's first round; term and attempt stay out, so a
    coordinator cannot draw again by replanning. Ed25519 signatures are deterministic, so the key is
    the driver's and fixed; a replica without the driver's private key cannot compute it."""
    return b"p2ptrain/pipeline-checks/v1\x00" + f"{plan.task_cid}/{plan.base_cid}/r{plan.round}".encode()
