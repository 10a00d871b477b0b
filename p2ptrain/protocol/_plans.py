"""What a coordinator's plan is made of: its members and their ring order, how many rounds it
covers (up to the next checkpoint), for a pipelined task the stage each member serves, and what
each member derives from it (a round's all-reduce id,
its data shard), and the rules a member holds the coordinator's plans to. Pure functions of the plan
and the task, shared by the planner (:class:`~p2ptrain.protocol.RoundBook`) and the members
that follow its plans."""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence

from p2ptrain.base import short_id
from p2ptrain.protocol._assignment import assign
from p2ptrain.protocol._records import quorum
from p2ptrain.protocol._recut import cut_problem, stage_costs
from p2ptrain.protocol._stage_costs import MOVE_MARGIN
from p2ptrain.task import Task, stage_parameters
from p2ptrain.protocol._voters import rank
from p2ptrain.wire import RoundPlan


def round_id(plan: RoundPlan, index: int) -> int:
    """The all-reduce's id for the ``index``-th round of the plan: a 64-bit hash of task, term,
    round and attempt, so every attempt of every task sharing a host gets a fresh id."""
    name = f"{plan.task_cid}/t{plan.term}/r{plan.round + index}/a{plan.attempt}"
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def round_seed(task: Task, round_index: int) -> int:
    """The seed of round ``round_index``'s top-k choices (which member picks which slice's indices,
    where the threshold sample starts): a 64-bit hash of the task's seed and the round's number only,
    so that the same round computes the same bits whichever term or attempt runs it (a run that
    resumes after a whole-run stop, under a new term, reproduces the run that did not stop)."""
    name = f"seed{task.seed}/r{round_index}"
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def owner_seed(plan: RoundPlan, round_index: int) -> int:
    """The seed that draws, in a robust round, who reduces and who checks each chunk
    (:mod:`p2ptrain.collective._owners`): a 64-bit hash of the plan's base (the run's last confirmed
    model, which members check against their chain) and the round's number. Nobody chooses it: the
    model is the previous span's all-reduce, fixed before this span's members are known, so no key a
    member picks makes it the owner of a chosen slice (issue 27). Term and attempt do not enter it,
    so a retry or a resumed run draws the same owners for the same ring."""
    name = f"owners/{plan.base_cid}/r{round_index}"
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def buffers_round_id(plan: RoundPlan) -> int:
    """The id of the all-reduce that averages the members' buffers at the end of ``plan``'s span
    (run/_spans.py): apart from every round's (:func:`round_id`)."""
    name = f"{plan.task_cid}/t{plan.term}/r{plan.round + plan.rounds - 1}/a{plan.attempt}/buffers"
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def shard_of(plan: RoundPlan, peer: str) -> tuple[int, int]:
    """``(rank, world_size)`` of ``peer`` in the plan: its index in the plan's member order; in a
    pipelined plan, among the members of stage 0 (only they read data and drive microbatches)."""
    if plan.stages is not None:
        drivers = stage_rings(plan)[0]
        return drivers.index(peer), len(drivers)
    return plan.members.index(peer), len(plan.members)


def stage_rings(plan: RoundPlan) -> list[tuple[str, ...]]:
    """The members of each stage of a pipelined plan, in the plan's ring order: the replicas whose
    gradients a stage's all-reduce sums (docs/pipeline.md)."""
    assert plan.stages is not None, "a plan without stages has one ring: its members"
    rings: list[list[str]] = [[] for _ in range(max(plan.stages) + 1)]
    for member, stage in zip(plan.members, plan.stages, strict=True):
        rings[stage].append(member)
    return [tuple(ring) for ring in rings]


def plan_order(plan: RoundPlan) -> tuple[int, int, int]:
    """Which of two plans comes later: by term, then attempt, then round. Within a term each plan
    the coordinator makes has a higher attempt than the one before (a retry, a takeover, a plan that
    goes back to the last checkpoint) or the same attempt and a later round (the next span); so a
    plan that goes back to an earlier round (:func:`orphaned_stages`) still supersedes the plans
    whose steps it redoes."""
    return plan.term, plan.attempt, plan.round


def follows_on(last: RoundPlan, plan: RoundPlan, version: int, head_step: int) -> bool:
    """Whether ``plan`` builds on the steps a member applied under ``last`` (the plan it took
    before), with the chain confirmed here at ``version`` (its head at ``head_step``): a plan from
    ``last``'s start or the head, or before; in ``last``'s term (whose coordinator made both) the
    next span of the same attempt or a retry of one of ``last``'s rounds with the next attempt;
    from another term (whose attempts start over, and whose coordinator follows on the plans it
    took, perhaps not this one's: refused, it would lead with no quorum, never outvoted) a plan
    from a checkpoint confirmed here or no later than ``last``'s base (a member may take a plan
    before the attestations of its base reach it). Else it came after a plan this member never took (its
    message lost, or its coordinator not known here yet), which may have redone steps it applied
    (RoundBook.holds_dropped). A member left out of such a plan is named again only from a
    checkpoint (plan_members admits joiners there alone), one it did not confirm."""
    if plan.step <= max(last.step, head_step):
        return True  # align rolls a step back, or a pipelined plan goes back to the head (rewinds)
    if plan.term != last.term:
        return plan.version <= max(version, last.version)
    end = last.round + last.rounds
    return (plan.attempt == last.attempt and plan.round == end) or (
        plan.attempt == last.attempt + 1 and last.round < plan.round < end)


def orphaned_stages(before: RoundPlan | None, members: Collection[str]) -> tuple[int, ...]:
    """The stages of ``before``'s assignment (a pipelined plan) none of whose replicas is among
    ``members``: what such a stage learnt since the last confirmed checkpoint went with its last
    replica, and the run can only go back to that checkpoint (:meth:`RoundBook.next_plan`)."""
    if before is None or before.stages is None:
        return ()
    kept = {s for m, s in zip(before.members, before.stages, strict=True) if m in members}
    return tuple(sorted(set(before.stages) - kept))


def stage_moves(before: RoundPlan | None, plan: RoundPlan) -> tuple[tuple[str, int, int], ...]:
    """``(member, stage before, stage now)`` of each member of both pipelined plans whose stage
    ``plan`` changed (a move into a stage left empty, or a rebalancing), in ``plan``'s order."""
    if before is None or before.stages is None or plan.stages is None:
        return ()
    was = dict(zip(before.members, before.stages, strict=True))
    return tuple((m, was[m], s) for m, s in zip(plan.members, plan.stages, strict=True) if was.get(m, s) != s)


def stage_round_id(plan: RoundPlan, index: int, stage: int) -> int:
    """The id of stage ``stage``'s all-reduce in the ``index``-th round of a pipelined plan: apart
    from every other stage's and from :func:`round_id`, so the S rounds run at once on one host."""
    name = f"{plan.task_cid}/t{plan.term}/r{plan.round + index}/a{plan.attempt}/s{stage}"
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def inner_round_id(plan: RoundPlan, index: int, inner: int) -> int:
    """The id of the summary of inner step ``inner`` in the ``index``-th round of a pipelined plan in
    local-SGD mode (one pass of the drivers' batch per inner step, run/_stages.py): apart from every
    other inner step's, every stage's sum (:func:`stage_round_id`) and :func:`round_id`."""
    name = f"{plan.task_cid}/t{plan.term}/r{plan.round + index}/a{plan.attempt}/i{inner}"
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def is_checkpoint(task: Task, round_index: int, total_steps: int) -> bool:
    """Whether round ``round_index`` (0-based, ending at step ``round_index + 1``) ends with a
    published model: every ``checkpoint_interval`` rounds, and the last round."""
    return (round_index + 1) % task.training.checkpoint_interval == 0 or round_index + 1 >= total_steps


def span_length(task: Task, round_index: int, total_steps: int) -> int:
    """Rounds from ``round_index`` up to and including the next checkpoint round."""
    interval = task.training.checkpoint_interval
    next_checkpoint = min((round_index // interval + 1) * interval, total_steps)
    return max(1, next_checkpoint - round_index)


def plan_members(
    task: Task, task_cid: str, previous: Sequence[str], live: Collection[str], admit_joiners: bool,
    private: Collection[str] = (), coordinator: str | None = None,
) -> tuple[str, ...] | None:
    """Members of the next span in ring order (:func:`ring_order`, given the members whose heartbeats
    say ``private``); None when no span may start now (see the module rules). Joiners come in by
    rank, the ``coordinator`` planning first: it follows its own plan, and a plan without it is none
    it can make (with more live peers than ``peers.max`` and itself ranked out, a fresh run's
    coordinator planned nothing, term after term). No member checks the joiners' order."""
    live = set(live)
    kept = [p for p in previous if p in live]
    if previous and len(kept) < quorum(len(previous)):
        return None
    members = sorted(kept)[: task.peers.max]
    if admit_joiners:
        joiners = sorted((p for p in live if p not in previous), key=lambda p: (p != coordinator, rank(task_cid, 0, p)))
        room = task.peers.max - len(members)
        if previous:
            room = min(room, joiner_room(len(members)))
        members += joiners[:room]
    if len(members) < task.peers.min:
        return None
    return ring_order(members, private)


def joiner_room(kept: int) -> int:
    """How many joiners a span of ``kept`` members of the previous one admits: at most ``kept - 1``
    (one for a lone member), so that if every joiner fails to take part (a Sybil that only
    advertised the task, issue 27) the retry without them still keeps a quorum of the plan's
    members, which every member requires of it (:func:`rule_problem`), and the run goes on."""
    return max(1, kept - 1)


def rule_problem(
    task: Task, total_steps: int, plan: RoundPlan, before: RoundPlan | None, micros: Sequence[int] | None = None,
    *, head: tuple[int, int, str] | None = None, times_cut: Sequence[int] | None = None,
) -> str | None:
    """Why an elected coordinator's ``plan`` breaks the run's rules, or None. The rules come from
    the task and from ``before`` (the latest plan the member took from a coordinator), never from the
    coordinator: the plan's members are distinct, admitted by the task and between ``peers.min`` and
    ``peers.max``; its span fits the task; and it keeps a quorum of ``before``'s members (no
    coordinator can swap the members out from under the run in one plan, which is also why a
    minority side of a partition never plans); its stages are :func:`plan_stages`' (``micros``: the
    stage times this member received in the summary of the step the plan starts at, if it applied
    it); its cut is one :func:`~p2ptrain.protocol._recut.cut_problem` accepts (``head``: the step,
    version and CID of this member's confirmed head, to tell whether the plan starts at its base's
    step; ``times_cut``: the cut the times ``micros`` were measured under). A plan that breaks them is evidence against its
    coordinator (:class:`~p2ptrain.protocol.RuleBreak`)."""
    peers = task.peers
    members = plan.members
    if len(set(members)) != len(members):
        return "members are not distinct"
    if not peers.min <= len(members) <= peers.max:
        return f"{len(members)} members, the task allows {peers.min} to {peers.max}"
    outsiders = [m for m in members if not peers.admits(m)]
    if outsiders:
        return f"it names {short_id(outsiders[0])}, whom the task's allowlist does not admit"
    if plan.rounds < 1 or plan.step + plan.rounds > total_steps:
        return f"a span of {plan.rounds} rounds from step {plan.step} does not fit the task"
    after = before is not None and plan_order(plan) > plan_order(before)
    if after:
        assert before is not None
        kept = len(set(before.members) & set(members))
        if kept < quorum(len(before.members)):
            return (f"it keeps {kept} of the {len(before.members)} members of plan {before.round}.{before.attempt}, "
                    f"a quorum is {quorum(len(before.members))}")
    # Whether the plan starts at its base, the confirmed checkpoint of its step (None: its base is ahead of this chain).
    checkpoint = None if head is None or plan.version > head[1] else (plan.step, plan.version, plan.base_cid) == head
    return (cut_problem(task, plan, before if after else None, micros, checkpoint, times_cut)
            or _stages_problem(task, plan, before if after else None, micros, times_cut))


def plan_stages(
    task: Task, members: Sequence[str], before: RoundPlan | None, micros: Sequence[int] | None = None,
    cut: Sequence[int] | None = None, times_cut: Sequence[int] | None = None,
) -> tuple[int, ...] | None:
    """The stage of each of ``members`` (in their order) for a pipelined task, None for any other:
    :func:`~p2ptrain.protocol._assignment.assign` from ``before``'s assignment (the latest plan
    taken from a coordinator) over the stages' parameter counts, or, under ``[pipeline] balance =
    "measured"`` and given the median stage times ``micros`` of the step the plan starts at, over
    their measured costs (protocol/_stage_costs.py; a move then needs :data:`MOVE_MARGIN`), the
    stages being those of the plan's ``cut`` (None: by parameter count) and the times measured under
    ``times_cut`` (protocol/_recut.py, ``stage_costs``). Pure:
    the coordinator plans it and every member that took ``before`` and applied that step computes
    the same."""
    if task.pipeline is None:
        return None
    previous = dict(zip(before.members, before.stages, strict=True)) if before and before.stages else None
    parameters = stage_parameters(task, cut)
    costs = stage_costs(task, cut, micros, times_cut)
    out = assign(members, costs or parameters, previous, margin=MOVE_MARGIN if costs else 1.0)
    return tuple(out[m] for m in members)


def _stages_problem(task: Task, plan: RoundPlan, before: RoundPlan | None, micros: Sequence[int] | None,
                    times_cut: Sequence[int] | None) -> str | None:
    """Why ``plan``'s stages break the rules: a stage for each member of a pipelined task (none for
    any other), each stage served; and, for a plan after ``before``, exactly :func:`plan_stages`,
    over the parameters or, under ``balance = "measured"``, over the times ``micros`` this member
    received alike with the others (a coordinator that did not apply the plan's start step, a
    resynced one, has no times and plans by parameters: either is one the member computes itself,
    so a coordinator chooses between those two, never the costs). A member that took no plan before
    (a joiner) checks the shape only: it does not know the assignment the coordinator started from;
    so does a member of a measuring task without the start step's times (it resynced to it): it
    does not know the costs, and the members that have them check the plan."""
    if task.pipeline is None:
        return None if plan.stages is None else "it assigns stages, the task has no [pipeline]"
    stages, count = plan.stages, task.pipeline.stages
    if stages is None or len(stages) != len(plan.members):
        return f"it assigns {len(stages or ())} stages to {len(plan.members)} members of a pipelined task"
    empty = sorted(set(range(count)) - set(stages))
    if empty or not all(0 <= s < count for s in stages):
        return f"its stages leave stage {empty[0]} without a member" if empty else f"a stage out of 0..{count - 1}"
    if before is None or (task.pipeline.measured_balance and not micros):
        return None
    expected = plan_stages(task, plan.members, before, cut=plan.cut)
    if expected != stages and (not micros or plan_stages(task, plan.members, before, micros, plan.cut, times_cut) != stages):
        assert expected is not None
        moved = next(m for m, s, e in zip(plan.members, stages, expected, strict=True) if s != e)
        return (f"it puts {short_id(moved)} in stage {stages[plan.members.index(moved)]}; the assignment from "
                f"plan {before.round}.{before.attempt} puts it in {expected[plan.members.index(moved)]}")
    return None


def ring_order(members: Collection[str], private: Collection[str]) -> tuple[str, ...]:
    """The order of a plan's members, which is the dense ring's (each member sends to the next and
    receives from the one before, the last wrapping to the first) and the ranks of data shards.

    A link between two private members (behind NATs, reached through a relay unless they share a
    LAN) crosses the relay's link twice and runs at the narrower of its rates; a link with a public
    member is direct (the private one dialed it). So the public members go first, sorted, and each
    is followed by one private member, sorted, while there are any: no two private members are
    ring neighbours when there are at least as many public members as private ones; otherwise the
    remaining private members come last, together, and the ring has as few private-private links as
    any order can (one per private member beyond the public ones). Without private members this is
    the sorted order, as plans were before reachability was known. Pure and deterministic from the
    members and the reachability they advertised (the coordinator's view; members do not recompute
    it, they check only that the members are distinct: :meth:`RoundBook.plan_problem`).
    """
    private = set(private)
    hidden = sorted(p for p in members if p in private)
    public = sorted(p for p in members if p not in private)
    order: list[str] = []
    for i, peer in enumerate(public):
        order.append(peer)
        if i < len(hidden):
            order.append(hidden[i])
    return tuple(order + hidden[len(public):])
