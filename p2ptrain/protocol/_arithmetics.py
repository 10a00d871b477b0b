"""Which live peers a run plans, by the arithmetic they advertise: the members of one run must
compute the same bits (docs/deploy.md, "Which machines compute the same bits").

Members attest a checkpoint by hashing their own state, so a member whose optimizer steps round
differently (torch's scalar CPU kernels among vectorized ones, another torch release, a GPU) never
attests the quorum's checkpoint. Planned anyway, such a member loads the confirmed state at every
checkpoint (three members and one odd one); two classes of two confirm nothing at all, and the run
stalls, since every later plan must keep a quorum of the previous plan's members. So plans keep to
one class. Pure: the planner (:func:`~p2ptrain.protocol._planner.decide`) and the node's control
loop (whether this member may stand for coordinator) read the same answer from the same inputs.

Rules, and why:

- A *class* is an advertised arithmetic (``Capabilities.arithmetic``: the torch release, and the
  CPU kernel set or the GPU) with the kernel sets measured to give the same bits folded into one:
  AVX-512 into AVX2 (keeping those apart would split pools that train together today). The torch
  release stays in it: releases are not known to agree.
- The run's class is the class of most members of the run's history (the latest plan taken, else the
  last confirmed record's members) still heard, advertising the task or not (done, or loading a
  checkpoint: else a left-out peer would see the run turn to its class when its members finish). A
  plan must keep a quorum of the previous plan's members
  (:func:`~p2ptrain.protocol._plans.rule_problem`), so no other class could plan at all. Without a
  history (a fresh run), the class of most live advertisers that took part in the run (voted, led,
  completed a round: :meth:`~p2ptrain.protocol.Participation.took_part`), this member counted too:
  the most members train, and a smaller class cannot hold the run hostage. Advertising alone does
  not count: three identities whose heartbeats named the task and another arithmetic took a fresh
  run's class, left both real members out, and since neither might stand, no vote was ever asked,
  which is what strikes a heartbeat-only identity (the run made no step in 90 s). A tie goes to the
  class of the peer with the lowest :func:`~p2ptrain.protocol._voters.rank` (a hash of the task CID
  and the peer ID): a peer ID is a key, so moving a tie means making keys after the task is
  published (and being admitted by its allowlist), not merely advertising another string; and a tie
  is only a tie, one more member makes a class the run's outright. Identities that vote but never
  plan hold a class only for a few terms: it then yields its claim, and its peers count for nothing
  until the first plan (:mod:`~p2ptrain.protocol._class_claims`, the ``live`` given here); ``peers.allow``
  keeps them out altogether, as everywhere else.
- Of the census, a class with fewer live peers than ``peers.min`` gives way to one with enough,
  where there is one (the census still orders those). A coordinator plans only peers of its own
  class, so one of a class too small to plan never plans, and nothing else ends its term: its
  heartbeats keep every member following it, and its silence costs its class nothing
  (:mod:`~p2ptrain.protocol._class_claims` counts only terms whose candidate is of the run's
  class). A coordinator's census is its own view, and lags: a vote that came after its election
  was not counted (it is now when it comes within the request's answer time:
  :func:`~p2ptrain.protocol.receive_noting`), so a scalar member elected in a fresh run's first term
  by one vectorized member's vote counted one peer of each class, the tie went to its class, and it led
  that term for good with two vectorized members live (tests/runtime/test_trailing_member.py, in
  loaded suites). Now its census names the vectorized class, which could plan: it does not lead,
  and steps down (tests/protocol/test_census_coordinator.py). Live counts only decide between
  classes of the census, so advertising alone still wins no class the run; where no class of the
  census could plan, the census decides as before, and the run waits for peers.
- A coordinator plans only from its own class, and only when that is the run's (it trains as a
  member and attests its own state: a plan of another class would have its own attestations differ
  every checkpoint). One whose class is not the run's neither plans nor stands for election
  (:attr:`Classes.may_lead`), so a member of the run's class leads. When even the run's class is
  short of ``peers.min`` nobody plans: the run waits for peers, as with too few peers of any kind.
- A peer that advertises no arithmetic (an older version, or one whose torch probe has not run
  yet, ~2 s after its start) is planned only where it cannot split the run: when it is a member of
  the history (it took part already, and leaving it out could cost the next plan its quorum of the
  previous members) or when no live peer advertises any arithmetic (a pool of older nodes, as
  before). A fresh run thus never starts with a member whose bits are unknown: one planned by
  chance into a first plan of two against two could stall the run for good. It waits for its next
  heartbeat and joins at a confirmed checkpoint like any joiner. The defence against a member that
  computes other bits all the same (unadvertised, or lying) stays the attestation quorum and the
  member's own check (``Attesting._check_own_state``, run/_attesting.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from p2ptrain.protocol._voters import rank

# Kernel sets measured to compute the same bits (docs/deploy.md's table): folded into the first.
_SAME_BITS = {" with AVX512 kernels": " with AVX2 kernels"}


def bits_class(arithmetic: str | None) -> str | None:
    """The class of ``arithmetic`` (as :func:`~p2ptrain.base.arithmetic_of` names it): arithmetics
    of one class compute the same bits; None when nothing is advertised."""
    if arithmetic is None:
        return None
    for alias, same in _SAME_BITS.items():
        if arithmetic.endswith(alias):
            return arithmetic[: -len(alias)] + same
    return arithmetic


@dataclass(frozen=True)
class Classes:
    """How one member sees the live peers' arithmetics (:func:`sort_classes`)."""

    run: str | None  # the run's class; None when no live peer advertises an arithmetic
    mine: str | None  # this member's own class
    # The live peers a coordinator of the run's class plans (this member among them when it is one).
    planned: frozenset[str] = frozenset()
    # The live peers left out for their arithmetic, with the arithmetic each advertises (None: none).
    left_out: Mapping[str, str | None] = field(default_factory=dict)

    @property
    def may_lead(self) -> bool:
        """Whether this member may stand and plan: its class is the run's (or nobody's is known)."""
        return self.run is None or self.mine == self.run


def sort_classes(
    task_cid: str, me: str, arithmetics: Mapping[str, str | None], history: Collection[str] = (),
    live: Collection[str] | None = None, took_part: Collection[str] | None = None, min_peers: int = 0,
) -> Classes:
    """The classes of the ``live`` peers (those that advertise the task; None: every peer
    ``arithmetics`` names) as ``me`` sees them. ``arithmetics``: the arithmetic each peer advertises
    (``me``'s own), for the live peers and for members of ``history`` still heard that do not
    advertise the task now (done, or loading a checkpoint: they still decide the run's class, or a
    run whose members finished would seem to change class). ``history``: the members of the latest
    plan taken (else of the last confirmed record), which decide the run's class when any of them
    is heard and known. ``took_part``: the live peers that took part in the run
    (:meth:`~p2ptrain.protocol.Participation.took_part`); without a history only they and ``me``
    are counted (None: every live peer). ``min_peers``: the task's ``peers.min``; without a history,
    a class of the census with fewer live peers than that gives way to one of the census that has
    enough (see the module docstring; 0: every class could plan)."""
    classes = {peer: bits_class(a) for peer, a in arithmetics.items()}
    live = set(classes) if live is None else set(live) & set(classes)
    known = [p for p in classes if classes[p] is not None]
    census = live if took_part is None else live & {me, *took_part}
    heard = [p for p in known if p in history]
    counted = heard or [p for p in known if p in census]
    if not counted:
        return Classes(run=None, mine=classes.get(me), planned=frozenset(live))
    sizes = Counter(classes[p] for p in counted)
    contenders = list(sizes)
    if not heard:  # the census: a class too small to plan gives way to one that could (module docstring)
        contenders = [c for c in sizes if sum(1 for p in live if classes[p] == c) >= min_peers] or contenders
    first = {c: min(rank(task_cid, 0, p) for p in counted if classes[p] == c) for c in contenders}
    run = min(contenders, key=lambda c: (-sizes[c], first[c]))
    planned = frozenset(p for p in live if classes[p] == run or (classes[p] is None and p in history))
    left_out = {p: arithmetics[p] for p in sorted(live) if p not in planned}
    return Classes(run=run, mine=classes.get(me), planned=planned, left_out=left_out)
