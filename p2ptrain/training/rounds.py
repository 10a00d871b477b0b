"""Round bookkeeping: who takes part in the next round, at which step, and when to checkpoint.

Every member keeps a :class:`RoundBook` (the last plan it followed and the confirmed chain), so when
the coordinator dies the next one continues from its own state instead of from scratch. All of it is
pure: the node decides when to call it.

Rules, and why:

- A round's members are the previous round's members that are still live, then joiners (in a fixed
  hash order) up to ``peers.max``. No round runs with fewer than ``peers.min`` members, nor without a
  quorum of the previous round's members: on the minority side of a partition nobody can plan, so
  the two sides never both extend the history.
- Joiners are admitted only when the members' state *is* the latest confirmed checkpoint (the round
  right after a confirmation, or the start), because a joiner loads that checkpoint by CID (weights
  and optimizer state) and must hold exactly what the others hold.
- After a checkpoint round the coordinator publishes a record and waits for its confirmation (or
  rejection) before the next plan (a barrier), so members still hold the checkpointed state when
  they attest, and joiners can come in right after a confirmation.
- A failed round (a member died during the all-reduce) is retried: same round, next attempt, same
  step, without the dead member. A member that applied the failed round's step rolls it back
  (:meth:`Trainer.align`); a member that cannot reach the plan's step stops advertising the task
  until it has resumed from the latest checkpoint.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from libp2p.crypto.keys import KeyPair

from p2ptrain.training.election import Election, rank
from p2ptrain.training.records import Chain, quorum, sign_record
from p2ptrain.training.task import Task
from p2ptrain.wire.messages import ModelRecord, RoundPlan, SignedModelRecord


def round_id(plan: RoundPlan) -> str:
    """The all-reduce's name for this round attempt (unique per task, round and attempt)."""
    return f"{plan.task_cid}/r{plan.round}/a{plan.attempt}"


def shard_of(plan: RoundPlan, peer: str) -> tuple[int, int]:
    """``(rank, world_size)`` of ``peer`` in the plan: its index among the sorted members."""
    return plan.members.index(peer), len(plan.members)


def is_checkpoint(task: Task, round_index: int, total_steps: int) -> bool:
    """Whether round ``round_index`` (0-based) ends with a published model: every
    ``checkpoint_interval`` rounds, and the last round."""
    return (round_index + 1) % task.training.checkpoint_interval == 0 or round_index + 1 >= total_steps


def plan_members(
    task: Task, task_cid: str, previous: Sequence[str], live: Collection[str], admit_joiners: bool
) -> tuple[str, ...] | None:
    """Members of the next round, sorted; None when no round may run now (see the module rules)."""
    live = set(live)
    kept = [p for p in previous if p in live]
    if previous and len(kept) < quorum(len(previous)):
        return None
    members = kept[: task.peers.max]
    if admit_joiners:
        joiners = sorted((p for p in live if p not in previous), key=lambda p: rank(task_cid, 0, p))
        members += joiners[: task.peers.max - len(members)]
    if len(members) < task.peers.min:
        return None
    return tuple(sorted(members))


@dataclass
class RoundBook:
    """What a member knows of the run: the last plan it followed and the confirmed chain."""

    task: Task
    task_cid: str
    chain: Chain
    total_steps: int
    last_plan: RoundPlan | None = None
    # The step of a checkpoint whose record was rejected: the barrier opens, training goes on, and
    # the next checkpoint tries again (joiners wait for a confirmed one).
    rejected_step: int | None = None

    @property
    def head_step(self) -> int:
        """The step of the latest confirmed model (0 for the initial model)."""
        return self.chain.records[-1].record.step if self.chain.records else 0

    def next_plan(self, election: Election, my_step: int, live: Collection[str]) -> RoundPlan | None:
        """As coordinator at optimizer step ``my_step``: the next plan, or None (wait, or done).

        ``live`` is the set of peers (the coordinator included) that advertise this task and meet
        its requirements. Continues after the last plan seen, whoever issued it: the next round if
        our own state completed it, else a retry of it.
        """
        if not election.is_coordinator or my_step >= self.total_steps:
            return None
        last = self.last_plan
        if last is None:
            round_index, attempt, previous = 0, 0, ()
        elif my_step == last.step + 1:
            round_index, attempt, previous = last.round + 1, 0, last.members
        elif my_step == last.step:
            round_index, attempt, previous = last.round, last.attempt + 1, last.members
        else:
            return None  # our state does not follow the last plan: not ours to continue from
        if last is not None and my_step == last.step + 1 and is_checkpoint(self.task, last.round, self.total_steps):
            if my_step not in (self.head_step, self.rejected_step):
                return None  # barrier: the checkpoint of the last round is not confirmed yet
        members = plan_members(self.task, self.task_cid, previous, live, admit_joiners=my_step == self.head_step)
        if members is None or election.me not in members:
            return None
        return RoundPlan(
            task_cid=self.task_cid, term=election.term, round=round_index, attempt=attempt, step=my_step,
            members=members, base_cid=self.chain.head_cid, version=self.chain.version,
        )

    def plan_problem(self, plan: RoundPlan, sender: str, election: Election) -> str | None:
        """Why a member should not follow ``plan``, or None. Records it as the last plan when followed."""
        if plan.task_cid != self.task_cid:
            return "plan for another task"
        if plan.term != election.term or sender != election.coordinator:
            return f"plan from {sender[-8:]} in term {plan.term}, not from the coordinator of term {election.term}"
        if election.me not in plan.members:
            return "not a member of this round"
        if list(plan.members) != sorted(set(plan.members)):
            return "members are not sorted and distinct"
        last = self.last_plan
        if last is not None and (plan.round, plan.attempt) <= (last.round, last.attempt):
            return f"round {plan.round}.{plan.attempt} is not after {last.round}.{last.attempt}"
        self.last_plan = plan
        return None

    def checkpoint_record(
        self,
        plan: RoundPlan,
        step: int,
        model_cid: str,
        optimizer_cid: str,
        metrics: dict[str, float],
        key_pair: KeyPair,
    ) -> SignedModelRecord:
        """As coordinator, after a checkpoint round: the signed record that extends the chain."""
        record = ModelRecord(
            task_cid=self.task_cid, version=self.chain.version + 1, parent=self.chain.head_cid,
            round=plan.round, step=step, members=plan.members, metrics=dict(metrics),
            model_cid=model_cid, optimizer_cid=optimizer_cid, term=plan.term, coordinator="",
        )
        return sign_record(record, key_pair)
