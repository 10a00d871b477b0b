"""A Byzantine member for tests and bench/robust.py, and digits training on real loopback hosts.

:class:`Hostile` wraps a real :class:`Collective`: the member's contribution is multiplied by
``factor`` after it was formed and just before it goes on the wire, so every byte the others see
travels the real path (frames, checks, the owners' reduction). Its index selection stays honest:
the attack is on the values, which every wire check accepts (finite, right count, right dtype).

:class:`Owner` is a member that attacks as a chunk's owner in a robust round: it writes values of
its own into the chunk it reduces (``poison``), or sends one member other bytes for its chunk than
the rest, signed with its own key like the real ones (``equivocate_to``: equivocation). It runs the
real code with two seams patched (:func:`install`): the owner's reduction and the frames it sends,
both only inside the task that :meth:`Owner.acting` marks (and the tasks it starts: a whole peer's,
if its node is started there), so the honest members in the same process are untouched.

The hostile *coordinator* of issue 27 (:func:`ground_key`, :func:`install_key`,
:func:`forge_records`): a key ground to be the task's designated candidate, and a full peer whose
records name only itself and a model nobody trained, attested by itself.

Loaded by path (bench/robust.py, bench/hostile_member.py, tests/collective/test_robust.py,
tests/runtime/test_hostile_coordinator.py), so it imports nothing from the test tree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from p2ptrain.collective import Collective, PeerFailed, RoundSpec, SparseAllReducer, _direct as direct
from p2ptrain.collective._links import RoundLinks
from p2ptrain.collective._witness import Witness
from p2ptrain.base._identity import KEY_FILE
from p2ptrain.protocol import signing
from p2ptrain.protocol._voters import designated
from p2ptrain.testing import connected_hosts
from p2ptrain.wire import DTYPES, SIGNATURE_BYTES, Phase, Said, abort_frame

ROUND_TIMEOUT_S = 20.0  # one training round of four members, generous for a loaded machine


class Hostile:
    """A member that sends ``factor`` times its contribution (100: scaled; -1: sign-flipped).

    It has the two methods :class:`SparseAllReducer` calls and forwards them to the real
    collective with the transformed tensor.
    """

    def __init__(self, collective: Collective, factor: float) -> None:
        self.collective = collective
        self.factor = factor

    async def dense_round(self, data: torch.Tensor, ring: list, round_id: int, spec: RoundSpec, **options) -> None:
        data.mul_(self.factor)  # the reducer sends a copy of its accumulated gradient; the result overwrites it
        await self.collective.dense_round(data, ring, round_id, spec, **options)

    async def sparse_round(self, source: torch.Tensor, ring: list, round_id: int, spec: RoundSpec, *, prepare=None,
                           **options):
        # ``source`` is filled by ``prepare`` (in a worker thread) and read only after it: transform
        # it there, into a tensor of our own, leaving the reducer's accumulated gradient honest.
        sent = torch.empty_like(source)

        def hostile_prepare() -> None:
            if prepare is not None:
                prepare()
            torch.mul(source, self.factor, out=sent)

        return await self.collective.sparse_round(sent, ring, round_id, spec, prepare=hostile_prepare, **options)


@asynccontextmanager
async def hosts(n: int) -> AsyncIterator[list[Collective]]:
    """``n`` real libp2p hosts on 127.0.0.1, every pair connected, each with a Collective."""
    async with connected_hosts(n) as peers:
        yield [Collective(peer.host) for peer in peers]


async def average_gradients(reducer: SparseAllReducer, model: torch.nn.Module, ring: list, round_id: int) -> None:
    """What a node does with a round: the model's flat gradient through the reducer (top-k over the
    whole vector), the members' mean written back as every parameter's ``.grad``."""
    params = list(model.parameters())
    mean = await reducer.allreduce(torch.cat([p.grad.reshape(-1) for p in params]), ring, round_id)
    offset = 0
    for p in params:
        p.grad.copy_(mean[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn digits scaled to [0, 1], split 1437 train / 360 test (fixed order)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16
    y = torch.tensor(data.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x, y, order[:1437], order[1437:]


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


async def train_digits(
    collectives: list[Collective], *, steps: int, robust: str, hostile: dict[int, float], density: float = 0.01,
    batch: int = 32, lr: float = 0.1, first_round: int = 0, on_round: Callable[[int, float], None] | None = None,
    owners: dict[int, Owner] | None = None, named: list | None = None, check_fraction: float = 1.0,
) -> tuple[float, list[torch.nn.Module]]:
    """Train the digits MLP on every host (member i holds shard i); ``hostile`` maps a member to its
    factor, ``owners`` to its :class:`Owner` attack (:func:`install` must be in effect). Returns
    member 0's test accuracy (0.0 if its weights are no longer finite) and the models.

    With ``owners``, a round that fails is run again without every member an honest one named (what
    the runtime's next plan does), and the names are appended to ``named``. ``check_fraction``: the
    share of chunks a robust round's verifiers recompute (collective._sampling). ``on_round(step,
    seconds)`` gets each round's wall time (all members, sync included).
    """
    x, y, train_idx, test_idx = digits()
    size = len(collectives)
    owners = owners or {}
    ring = [c.peer_id for c in collectives]
    live = list(range(size))
    models = [mlp() for _ in range(size)]
    spec = RoundSpec(density=density, robust=robust, check_fraction=check_fraction, timeout=ROUND_TIMEOUT_S)
    reducers = [
        SparseAllReducer(Hostile(c, hostile[i]) if i in hostile else c, spec)
        for i, c in enumerate(collectives)
    ]
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr) for m in models]
    shards = [train_idx[i::size] for i in range(size)]
    failures: dict[int, Exception] = {}

    async def member(i: int, step: int, round_id: int) -> None:
        pick = torch.randint(len(shards[i]), (batch,), generator=torch.Generator().manual_seed(step * 10 + i))
        chosen = shards[i][pick]
        optimizers[i].zero_grad()
        torch.nn.functional.cross_entropy(models[i](x[chosen]), y[chosen]).backward()
        members = [ring[m] for m in live]
        try:
            if i in owners:
                with owners[i].acting():
                    await average_gradients(reducers[i], models[i], members, round_id)
            else:
                await average_gradients(reducers[i], models[i], members, round_id)
        except PeerFailed as error:
            if not owners:
                raise
            failures[i] = error

    round_id = first_round
    for step in range(steps):
        started = trio.current_time()
        while True:
            failures.clear()
            with trio.fail_after(ROUND_TIMEOUT_S):
                async with trio.open_nursery() as nursery:
                    for i in live:
                        nursery.start_soon(member, i, step, round_id)
            round_id += 1
            if not failures:
                break
            culprits = {ring.index(e.peer_id) for i, e in failures.items() if i not in owners and e.peer_id in ring}
            if not culprits:
                raise next(iter(failures.values()))
            live = [i for i in live if i not in culprits]
            if named is not None:
                named.extend(sorted(culprits))
        for i in live:
            optimizers[i].step()
        if on_round is not None:
            on_round(step, trio.current_time() - started)
    with torch.no_grad():
        logits = models[0](x[test_idx])
        accuracy = (logits.argmax(1) == y[test_idx]).float().mean().item() if bool(logits.isfinite().all()) else 0.0
    return accuracy, models


class Owner:
    """What a hostile owner does in the rounds it takes part in (see the module docstring; with
    none of them it is honest: an attack can be switched on mid-run):
    ``poison``, a value written into every value of the chunk it reduces; ``flip``: its chunk
    negated (the same norm: inside the bound every member checks in a sampled round, so only a
    verifier's recomputation catches it); ``equivocate_to``, a
    peer ID that gets this owner's chunk plus one, signed anew (``resign=False``: under the
    signature of the real chunk); ``split``: as a contributor, it
    sends each chunk's verifier its values plus one (the owners get the signed, honest ones);
    ``blame``, a peer ID: in a sampled round whose draws (learnt at CONFIRM) pick its own chunk, it
    ends the round before the check with an abort notice naming that peer (docs/collective.md,
    "Abort notices while a drawn chunk is checked"): on streams of its own, as its hub sends them,
    or (``in_band``) as an ABORT frame instead of the check's frames on each of its round channels
    but one: its chunk's verifier gets its real VERIFY copy first (so the verifier's check runs and
    fails, and the members that miss their copies must not wait on its verdict forever), and it
    leaves without a notice of its hub's."""

    def __init__(self, collective: Collective, *, poison: float | None = None, flip: bool = False,
                 equivocate_to=None, split: bool = False, resign: bool = True, blame=None,
                 in_band: bool = False) -> None:
        self.collective = collective
        self.poison = poison
        self.flip = flip
        self.equivocate_to = equivocate_to
        self.split = split
        self.resign = resign  # False: the altered chunk goes with the signature of the real one
        self.blame = blame
        self.in_band = in_band
        self._escaping: ID | None = None  # in_band, its chunk drawn: its verifier, which gets its real copy
        self._copied = trio.Event()  # ... once that copy is sent
        self._witness: Witness | None = None
        self._verifying = False
        self._altered: dict[int, hashlib._Hash] = {}  # chunk -> SHA-256 of the altered bytes sent so far

    @contextmanager
    def acting(self) -> Iterator[None]:
        """Within this block (and the tasks it starts) this member is the hostile owner."""
        token = _acting.set(self)
        try:
            yield
        finally:
            _acting.reset(token)


def acting_at(attacker: Owner, bad: int, call: Callable[[int], Awaitable[Any]]) -> Callable[[int], Awaitable[Any]]:
    """Member ``i``'s part of a round, ``call(i)``: member ``bad``'s as ``attacker``'s hostile owner."""
    async def member(i: int) -> Any:
        if i != bad:
            return await call(i)
        with attacker.acting():
            return await call(i)

    return member


_acting: ContextVar[Owner | None] = ContextVar("p2ptrain_test_hostile_owner", default=None)
_TORCH_DTYPES = {code: dtype for dtype, code in DTYPES.items()}


def _plus_one(payload, dtype: torch.dtype) -> bytes:
    """Other values than the segment ``payload`` holds, still finite: every one plus one."""
    if not len(payload):
        return b""
    return (torch.frombuffer(bytearray(payload), dtype=dtype) + 1).view(torch.uint8).numpy().tobytes()


class Patches:
    """What pytest's ``monkeypatch`` does for :func:`install`, for a process without pytest (the
    chaos bench): ``setattr`` remembers what it replaced, ``undo`` puts it back."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def setattr(self, target: Any, name: str, value: Any) -> None:
        self._saved.append((target, name, getattr(target, name)))
        setattr(target, name, value)

    def undo(self) -> None:
        while self._saved:
            target, name, value = self._saved.pop()
            setattr(target, name, value)


@contextmanager
def installed() -> Iterator[None]:
    """:func:`install` for the duration of the block."""
    patches = Patches()
    install(patches)
    try:
        yield
    finally:
        patches.undo()


def install(monkeypatch) -> None:
    """Patch the seams :class:`Owner` acts through (pytest's ``monkeypatch`` undoes it)."""
    reduce_chunk, check_chunk, send, witness_init = direct.reduce_chunk, direct._check_chunk, RoundLinks.send, Witness.__init__
    drawn_of = direct.drawn_chunks

    def hostile_reduce(parts, start, spec, norms=None):
        out = reduce_chunk(parts, start, spec, norms)
        owner = _acting.get()
        if owner is not None and owner.poison is not None and not owner._verifying:
            out = [torch.full_like(part, owner.poison) for part in out]
        if owner is not None and owner.flip and not owner._verifying:
            out = [torch.neg(part) for part in out]
        return out

    def honest_check(*args, **kwargs):  # as a verifier it checks honestly: the attack is on its own chunk
        owner = _acting.get()
        if owner is not None:
            owner._verifying = True
        try:
            return check_chunk(*args, **kwargs)
        finally:
            if owner is not None:
                owner._verifying = False

    def remember_witness(self, *args, **kwargs):
        witness_init(self, *args, **kwargs)
        owner = _acting.get()
        if owner is not None:
            owner._witness = self

    async def equivocating_send(self, header, payload=b"", *, to=None):
        owner = _acting.get()
        if owner is not None and owner._escaping is not None and header.phase in (Phase.VERIFY, Phase.CHECKED):
            if to == owner._escaping and header.phase == Phase.VERIFY:
                await send(self, header, payload, to=to)
                owner._copied.set()
                return
            await owner._copied.wait()
            frame = abort_frame(self.round_id, owner.blame, "did not answer within the deadline")
            for peer, channel in self._outbound.items():
                if peer != owner._escaping:
                    await channel.send(frame)
            owner._escaping = None
            # Reported by someone else: its hub sends no notice of its own, and it resets its channels.
            raise PeerFailed(owner.blame, "did not answer within the deadline", reported_by=owner.blame)
        if owner is not None and owner.split and header.phase == Phase.VERIFY:
            payload = _plus_one(payload, _TORCH_DTYPES[header.dtype])
        if (owner is not None and owner.equivocate_to is not None and to == owner.equivocate_to
                and header.phase == Phase.GATHER and owner._witness is not None):
            # A segment of its chunk's values, other values, still finite; the last one carries the
            # chunk's signature (then made anew over the altered values, unless resign is False).
            # Not in a round whose Witness was made before these attacks were installed (_witness
            # None): it has no statement to sign anew, and it goes on honestly.
            dtype = _TORCH_DTYPES[header.dtype]
            size = header.count * torch.empty((), dtype=dtype).element_size()
            values, trailer = _plus_one(bytes(payload[:size]), dtype), bytes(payload[size:])
            altered = owner._altered.setdefault(header.step, hashlib.sha256())
            altered.update(values)
            if trailer:
                del owner._altered[header.step]
                if owner.resign:
                    statement = owner._witness.statement(Said.RESULT, header.step, altered.digest())
                    trailer = owner.collective.host.get_private_key().sign(statement) + trailer[SIGNATURE_BYTES:]
            payload = values + trailer
        await send(self, header, payload, to=to)

    def escaping_drawn(witness, owners, draws, fraction):
        chosen = drawn_of(witness, owners, draws, fraction)
        owner = _acting.get()
        if owner is not None and owner.blame is not None and owners.owned_by(witness.links.me) in chosen:
            if owner.in_band:
                mine = owners.owned_by(witness.links.me)
                owner._escaping, owner._copied = witness.links.ring[owners.verifier[mine]], trio.Event()
                return chosen
            # A failure "seen" here (reported_by None): the hub tells every member, as an honest one would.
            raise PeerFailed(owner.blame, "did not answer within the deadline")
        return chosen

    monkeypatch.setattr(direct, "reduce_chunk", hostile_reduce)
    monkeypatch.setattr(direct, "drawn_chunks", escaping_drawn)
    monkeypatch.setattr(direct, "_check_chunk", honest_check)
    monkeypatch.setattr(Witness, "__init__", remember_witness)
    monkeypatch.setattr(RoundLinks, "send", equivocating_send)


# ---- the hostile coordinator ----------------------------------------------------------------------


def ground_key(task_cid: str, others: list[str], terms: range) -> KeyPair:
    """A key whose peer is the designated candidate of every term in ``terms`` among ``others``
    (and so among any subset of them: the designated one is the lowest rank)."""
    while True:
        key = create_new_key_pair()
        me = signing.peer_str(key)
        if all(designated(task_cid, term, [me, *others]) == me for term in terms):
            return key


def install_key(home: Path, key: KeyPair) -> None:
    """Make ``key`` the identity of a node to be started on ``home`` (which must not exist yet)."""
    home.mkdir(parents=True, mode=0o700)
    fd = os.open(home / KEY_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_key.serialize())


def forge_records(run: Any, poison: str, named: int | None) -> None:
    """Make the hostile member's records (``run``: its TaskRun) name only itself (and ``named - 1``
    of the span's other members; with ``named`` None, the plan's members as they are) and a model
    nobody trained (``poison``), with a flattering accuracy, and its own attestation match them.

    Patched on the class, for the book ``run`` holds whenever it makes a record: a resync replaces
    the run's book (a member that joined a run under way resyncs whenever it falls behind)."""
    from p2ptrain.protocol._round_book import RoundBook

    _forged_runs.append((run, poison, named))
    if getattr(RoundBook.checkpoint_record, "forging", False):
        return
    honest = RoundBook.checkpoint_record

    def forged(book, plan, step, model_cid, optimizer_cid, metrics, key_pair, votes=()):  # type: ignore[no-untyped-def]
        for hostile_run, poisoned, count in _forged_runs:
            if hostile_run.shared.book is book:
                me = hostile_run.shared.me
                hostile_run.attesting.checkpoint_cids[step] = (poisoned, poisoned)  # so that it attests the poison
                few = plan if count is None else dataclasses.replace(
                    plan, members=(me, *[m for m in plan.members if m != me][: count - 1]))
                return honest(book, few, step, poisoned, poisoned, {**metrics, "accuracy": 0.99}, key_pair, votes)
        return honest(book, plan, step, model_cid, optimizer_cid, metrics, key_pair, votes)

    forged.forging = True  # type: ignore[attr-defined]
    RoundBook.checkpoint_record = forged  # type: ignore[method-assign]


_forged_runs: list[tuple[Any, str, int | None]] = []  # (a hostile TaskRun, its poison CID, members it names)
