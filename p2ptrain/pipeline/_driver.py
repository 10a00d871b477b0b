"""A member of stage 0 drives microbatches through the pipeline and back, rerouting around failures.

For each microbatch the driver runs its own stage 0, then sends the activation forward through one
replica of every later stage (chosen by :class:`~p2ptrain.pipeline._wiring.Wiring`), the last of
which computes the loss and answers with the gradient of its input; the gradients then come back
through one replica of every stage (``BACKWARD``: the stage's input again and its output's gradient,
sent first to the replica that served the microbatch's FORWARD, which kept its graph and so skips
recomputing its forward), and the driver backpropagates through its stage 0. Every hop is one request and one answer on a
channel to the replica, reused from hop to hop (:class:`~p2ptrain.pipeline._channels.ChannelPool`);
a hop whose replica closes the channel, answers garbage or answers too late (past a deadline
from that replica's measured hop times: :class:`~p2ptrain.pipeline._deadlines.HopDeadlines`) is sent,
with the same bytes, to another replica of the stage, and that replica is out for the step. An
answer's shape must be the one the stage computes (each stage's output shape for its input's, found
once on the meta device from the model's cut): a replica that answers an activation of another
shape is the one blamed, not the replicas of the next stage that cannot use it. A replica that answers
in time but slowest of its stage again and again (stalling under its deadline) is judged by
:class:`~p2ptrain.pipeline.Stragglers` at :meth:`Driver.finish`: an accusation
(:attr:`Driver.stragglers`, which the runtime says in the step summary as it says :attr:`Driver.liars`).

The driver keeps every microbatch's boundary tensors (each stage's input, and the gradient of its
output) until the step ends, so any hop can be redone anywhere: at :meth:`Driver.finish` it asks every
replica which microbatches its gradients hold, and redoes on a live replica each of its own
microbatches that only a dead replica held. Then each stage's live replicas together hold every
microbatch exactly once (a microbatch held twice is :class:`DoubleCounted`), and their summed
gradients are the step's gradient of that stage (docs/pipeline.md).

Integrity: with ``check_fraction`` > 0, that share of the microbatches gets a second opinion on each of
its hops from another replica of the stage (a FORWARD again, the two outputs compared bit for bit:
replicas of a stage hold the same weights; a LOSS or BACKWARD as ``CHECK_LOSS`` or ``CHECK_BACKWARD``,
which compute the gradient of the stage's input, and the loss, and accumulate nothing), and a third
opinion on a difference, whose loser is a liar (pipeline/_opinions.py: :attr:`Driver.liars`,
:attr:`Driver.outvoted`, :attr:`Driver.disagreements`, :attr:`Driver.undecided`). Every microbatch
travels alike during the step: the second opinions are asked at :meth:`Driver.finish`, from the
boundaries the driver keeps anyway, so a replica cannot tell from the timing of its requests which of
its answers will be checked (asked in line, a checked microbatch came back a hop later). A lie found
in an answer that went on fails the step (:class:`Outvoted`). Which microbatches are checked is
drawn by :func:`is_checked` from a key the runtime derives from the plan with the driver's own
signature (a replica cannot compute it, the driver cannot choose it), not from a random generator
the driver seeds.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field

import torch
import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from torch import nn

from p2ptrain.base import short_id
from p2ptrain.net import ChannelError
from p2ptrain.pipeline._channels import ChannelPool
from p2ptrain.pipeline._deadlines import HopDeadlines
from p2ptrain.pipeline._opinions import Hop, is_checked, Opinions
from p2ptrain.pipeline._partition import output_shape, Stage
from p2ptrain.pipeline._replica import Loss, PROTOCOL
from p2ptrain.pipeline._stragglers import Stragglers
from p2ptrain.pipeline._wiring import Wiring
from p2ptrain.wire.activations import ActivationError, decode_frame, DEFAULT_LIMITS, encode_frame, Frame, Kind, Limits

logger = logging.getLogger(__name__)

# A hop's deadline before any is measured, and its least (a tiny stage answers in milliseconds on
# loopback), and its most however slow the replica's hops were measured (pipeline/_deadlines.py).
HOP_TIMEOUT_S = 10.0
HOP_CEILING_S = 60.0


class PipelineError(Exception):
    """A step that cannot complete (the base of this module's errors)."""


class StageUnavailable(PipelineError):
    """Every replica of a stage failed this step."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        super().__init__(f"no replica of stage {stage} is left this step")


class DoubleCounted(PipelineError):
    """Two live replicas of a stage both hold a microbatch's gradient (an answer that arrived late)."""


class Outvoted(PipelineError):
    """A second and a third opinion outvoted an answer that went on down the pipeline: the step's
    gradients hold a replica's lie (the liar is in :attr:`Driver.liars`; the step is retried)."""


class _BadAnswer(Exception):
    """An answer that does not answer the request sent."""


@dataclass
class _Microbatch:
    targets: torch.Tensor
    weight: float
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # what stage s was sent (s >= 1)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # the gradient of stage s's output
    loss: float = 0.0
    done: bool = False  # its gradient came back through stage 0
    # A checked microbatch's hops, for the second opinions at the step's end (None: not checked).
    hops: list[Hop] | None = None


class Driver:
    """A stage-0 member driving its microbatches of each step through the pipeline.

    ``cut``: every stage of the model, in order (their tensors anywhere, the meta device included:
    only their shapes are used), from which the driver knows what shape each stage must answer.
    ``deadlines``: each hop's (a runtime keeps one across its plans); by default from ``hop_timeout``
    (the least and the first) up to :data:`HOP_CEILING_S`.
    """

    def __init__(
        self, host: IHost, stage: Stage, loss: Loss, wiring: Wiring, *, cut: Sequence[nn.Module], encoding: str = "fp32",
        limits: Limits = DEFAULT_LIMITS, hop_timeout: float = HOP_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic, check_fraction: float = 0.0, check_key: bytes = b"",
        protocol: str = PROTOCOL, pool: ChannelPool | None = None, deadlines: HopDeadlines | None = None,
        stragglers: Stragglers | None = None,
    ) -> None:
        if stage.index != 0:
            raise ValueError("a driver serves stage 0")
        if len(cut) != stage.count:
            raise ValueError(f"the cut has {len(cut)} stages, not {stage.count}")
        self.host, self.stage, self.loss, self.wiring = host, stage, loss, wiring
        self.encoding, self.limits, self.hop_timeout, self.clock = encoding, limits, hop_timeout, clock
        self.protocol = protocol  # the replicas' (a runtime names one per task)
        # Channels to the replicas, reused hop after hop (a runtime keeps one pool across its plans).
        self.pool = pool if pool is not None else ChannelPool(host, protocol, clock=clock)
        self.deadlines = deadlines or HopDeadlines(hop_timeout, ceiling=max(hop_timeout, HOP_CEILING_S))
        # Which replicas stall this driver's steps (pipeline/_stragglers.py; a runtime keeps one across its plans).
        self.straggling = stragglers or Stragglers()
        # {replica: its stage} of the stragglers found (the caller takes them: its accusations).
        self.stragglers: dict[Hashable, int] = {}
        self.cut = list(cut)
        # {(stage, input shape, input dtype): the stage's output shape}, each computed once on the meta device.
        self._shapes: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Size] = {}
        self.step = 0
        self._microbatches: dict[int, _Microbatch] = {}
        self._opinions_asked = False  # this step's second opinions (finish may be called again)
        # {(stage, microbatch): the replicas sent its LOSS or BACKWARD this step}: only they may hold it.
        self._sent: dict[tuple[int, int], set[Hashable]] = {}
        self._lock = trio.Lock()  # stage 0's graph and gradients, one computation at a time
        self.reroutes = self.redone = 0
        self.timeouts = 0  # hops rerouted because their deadline passed
        if not 0.0 <= check_fraction <= 1.0:
            raise ValueError(f"check_fraction must be in [0, 1], not {check_fraction}")
        self.check_fraction = check_fraction
        # What draws the checked microbatches (is_checked): the runtime's, its signature of the plan (no replica knows it).
        self.check_key = check_key
        # What second opinions found, kept across steps (pipeline/_opinions.py); the caller takes the liars and undecided pairs.
        self.opinions = Opinions()
        self.disagreements, self.outvoted = self.opinions.disagreements, self.opinions.outvoted
        self.liars, self.undecided = self.opinions.liars, self.opinions.undecided

    @property
    def checked(self) -> int:
        """FORWARD second opinions asked."""
        return self.opinions.checked

    @property
    def gradients_checked(self) -> int:
        """CHECK_LOSS and CHECK_BACKWARD second opinions asked."""
        return self.opinions.gradients_checked

    async def aclose(self) -> None:
        """Close the channels kept to the replicas (the driver is done)."""
        await self.pool.aclose()

    def new_step(self, step: int) -> None:
        """Start ``step``: stage 0's gradients zeroed, the kept tensors dropped, every replica usable."""
        self.step = step
        self._microbatches.clear()
        self._opinions_asked = False
        self._sent.clear()
        self.straggling.new_step()
        self.wiring.new_step()
        for p in self.stage.parameters():
            p.grad = None

    async def microbatch(self, mb: int, x: torch.Tensor, targets: torch.Tensor, weight: float) -> float:
        """Run microbatch ``mb`` (an id unique in the step across drivers) forward and back; its
        gradient, times ``weight`` (its share of the step), ends in every stage. Returns its loss."""
        count = self.stage.count
        record = self._microbatches[mb] = _Microbatch(targets, weight)
        if count == 1:
            async with self._lock:
                record.loss = await trio.to_thread.run_sync(self._local_loss, x, targets, weight)
            record.done = True
            return record.loss
        async with self._lock:
            began = self.clock()
            h = await trio.to_thread.run_sync(self._forward0, x)
            self.deadlines.answered(0, None, self.clock() - began, 0)  # stage 0's own time (HopDeadlines.stage_micros)
        a = h.detach()
        # Drawn here, seen by nobody else: a checked microbatch travels as any other, and only keeps
        # its hops (their tensors are the boundaries kept anyway) for finish's second opinions.
        if self.check_fraction > 0 and is_checked(self.check_key, self.step, mb, self.check_fraction):
            record.hops = []
        served: dict[int, Hashable] = {}  # {stage: the replica whose output went on}: it kept the graph
        for s in range(1, count - 1):
            record.inputs[s] = a
            served[s], answer = await self._answered(Kind.FORWARD, s, mb, (a,))
            _keep(record, Kind.FORWARD, s, mb, (a,), 0.0, served[s], answer)
            a = answer.tensors[0]
        record.inputs[count - 1] = a
        tensors: tuple[torch.Tensor, ...] = (a, targets)
        peer, answer = await self._answered(Kind.LOSS, count - 1, mb, tensors, weight)
        _keep(record, Kind.CHECK_LOSS, count - 1, mb, tensors, weight, peer, answer)
        record.loss, g = answer.value, answer.tensors[0]
        for s in range(count - 2, 0, -1):
            record.grads[s] = g
            tensors = (record.inputs[s], g)
            peer, answer = await self._answered(Kind.BACKWARD, s, mb, tensors, prefer=served[s])
            _keep(record, Kind.CHECK_BACKWARD, s, mb, tensors, 0.0, peer, answer)
            g = answer.tensors[0]
        async with self._lock:
            began = self.clock()
            await trio.to_thread.run_sync(h.backward, g)
            self.deadlines.answered(0, None, self.clock() - began, 0)
        record.done = True
        return record.loss

    def _forward0(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            out: torch.Tensor = self.stage(x)
        return out

    def _local_loss(self, x: torch.Tensor, targets: torch.Tensor, weight: float) -> float:
        with torch.enable_grad():
            loss = self.loss(self.stage(x), targets)
            (loss * weight).backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return float(loss.detach())

    async def _answered(
        self, kind: Kind, stage: int, mb: int, tensors: tuple[torch.Tensor, ...], value: float = 0.0,
        besides: Collection[Hashable] = (), prefer: Hashable | None = None,
    ) -> tuple[Hashable, Frame]:
        """The replica of ``stage`` (none of ``besides``) that answered this request, and its answer.
        ``prefer``: the replica tried first while it is usable (a BACKWARD goes back to the replica
        that served the microbatch's FORWARD, which kept its graph), else the wiring's draw."""
        request = encode_frame(Frame(kind, self.step, mb, stage, value, tensors), self.encoding)
        while True:
            usable = prefer is not None and prefer not in besides and prefer in self.wiring.usable(stage)
            peer = prefer if usable else self.wiring.choose(stage, besides)
            prefer = None
            if peer is None:
                raise StageUnavailable(stage)
            queued = self.wiring.in_flight(peer)
            self.wiring.started(peer)
            if kind in (Kind.LOSS, Kind.BACKWARD):
                self._sent.setdefault((stage, mb), set()).add(peer)
            deadline = self.deadlines.deadline(stage, peer, len(request))
            began = self.clock()
            try:
                with trio.fail_after(deadline):
                    answer = await self._ask(peer, request, kind, stage, mb, tensors[0])
            except (ChannelError, ActivationError, trio.TooSlowError, _BadAnswer) as error:
                if isinstance(error, trio.TooSlowError):
                    self.deadlines.timed_out(stage, peer, deadline)
                    self.timeouts += 1
                    self.straggling.took(stage, peer, math.inf)
                self.wiring.failed(peer)
                self.reroutes += 1
                logger.info("pipeline step %d: microbatch %d: stage %d replica %s failed (%s); rerouting",
                            self.step, mb, stage, _name(peer), str(error) or type(error).__name__)
                continue
            seconds = self.clock() - began
            self.wiring.finished(peer, seconds)
            self.deadlines.answered(stage, peer, seconds, len(request), queued)
            self.straggling.took(stage, peer, seconds / (1 + queued))  # its share of the wait: the hops queued before it
            return peer, answer

    def _judge_stalls(self) -> None:
        """The step's answers judged (pipeline/_stragglers.py): a replica that stalled this driver's
        steps again is its accusation. Not distrusted: slowness is no evidence of who caused it, the
        wiring sends a slow replica few hops, and a misjudged one could leave no replica of a stage."""
        for peer, stage in self.straggling.judge().items():
            logger.warning("pipeline step %d: stage %d replica %s stalls this driver's steps (slowest of its stage "
                           "again and again); accused", self.step, stage, _name(peer))
            self.stragglers[peer] = stage

    async def _another(
        self, kind: Kind, stage: int, mb: int, tensors: tuple[torch.Tensor, ...], value: float,
        besides: Collection[Hashable],
    ) -> tuple[Hashable, Frame] | None:
        """A second or third opinion (pipeline/_opinions.py's ``Ask``): the hop asked of a replica of
        ``stage`` none of ``besides``, or None when none is left."""
        try:
            return await self._answered(kind, stage, mb, tensors, value, besides)
        except StageUnavailable:
            return None

    async def _ask(
        self, peer: Hashable, request: bytes, kind: Kind, stage: int, mb: int, sent: torch.Tensor,
    ) -> Frame:
        """``peer``'s answer to ``request``, checked (:meth:`_check`); the channel goes back to the
        pool only with an answer that passed."""
        assert isinstance(peer, ID)
        async with self.pool.channel(peer) as channel:
            await channel.send(request)
            answer = decode_frame(await channel.recv(self.limits.max_frame_bytes()), self.limits)
            self._check(answer, kind, stage, mb, sent)
        return answer

    def _check(self, answer: Frame, kind: Kind, stage: int, mb: int, sent: torch.Tensor) -> None:
        expected = Kind.OUTPUT if kind == Kind.FORWARD else Kind.HELD if kind == Kind.HOLDINGS else Kind.GRAD
        if (answer.kind, answer.step, answer.stage) != (expected, self.step, stage):
            raise _BadAnswer(f"answer {answer.kind} for stage {answer.stage} step {answer.step}")
        if kind == Kind.HOLDINGS:
            if len(answer.tensors) > 1 or (answer.tensors and (answer.tensors[0].dtype != torch.int64
                                                               or answer.tensors[0].dim() != 1)):
                raise _BadAnswer("holdings are one list of microbatch ids")
            return
        if answer.microbatch != mb or len(answer.tensors) != 1 or answer.tensors[0].dtype != torch.float32:
            raise _BadAnswer(f"answer for microbatch {answer.microbatch} with {len(answer.tensors)} tensors")
        got = answer.tensors[0].shape
        shape = self._output_shape(stage, sent) if kind == Kind.FORWARD else sent.shape
        if got != shape:
            raise _BadAnswer(f"answer of shape {tuple(got)} to an input of {tuple(sent.shape)}, not {tuple(shape)}")

    def _output_shape(self, stage: int, sent: torch.Tensor) -> torch.Size:
        key = (stage, tuple(sent.shape), sent.dtype)
        if key not in self._shapes:
            self._shapes[key] = output_shape(self.cut[stage], sent)
        return self._shapes[key]

    async def finish(self, left_out: Collection[Hashable] = ()) -> dict[int, list[Hashable]]:
        """End the step: the checked microbatches' second opinions asked (once a step; :class:`Outvoted`
        when a third opinion outvoted an answer the step went on with), then every microbatch of this
        driver held once by each later stage (redone where a dead replica took it along); returns,
        per stage from 1, the replicas that answered (the stage's ring for averaging). Stage 0's ring
        is the drivers'.

        ``left_out``: replicas another driver could not reach, treated as dead here too. Drivers
        agree on the rings by calling ``finish`` again with every replica any of them left out, until
        their rings are equal (what each driver redoes is its own microbatches only)."""
        for peer in left_out:
            self.wiring.leave_out(peer)
        unfinished = sorted(mb for mb, record in self._microbatches.items() if not record.done)
        if unfinished:
            # Its gradient is in some stages and not in others: the step cannot be summed; the
            # runtime reports the round failed and starts the step again (new_step).
            raise PipelineError(f"step {self.step}: microbatches {unfinished} did not complete")
        if not self._opinions_asked:
            self._opinions_asked = True
            hops = [hop for mb in sorted(self._microbatches) for hop in self._microbatches[mb].hops or ()]
            poisoned = await self.opinions.check(self._another, self.step, hops)
            for liar in self.liars:  # caught here: none of this driver's hops go there again
                self.wiring.distrust(liar)
            if poisoned:
                raise Outvoted(f"step {self.step}: " + ", ".join(
                    f"microbatch {h.microbatch}'s answer at stage {h.stage} from {_name(h.peer)}" for h in poisoned)
                    + " outvoted by a third opinion")
        rings: dict[int, list[Hashable]] = {}
        redone: dict[tuple[int, int], Hashable] = {}  # (stage, microbatch): the replica that answered its redo
        for stage in range(1, self.stage.count):
            while True:
                held = await self._holdings(stage)
                for peer in [p for p, ids in held.items() if any(p not in self._sent.get((stage, i), ()) for i in ids)]:
                    # It claims a microbatch of this driver's it was never sent: a lie that would
                    # fail the step as DoubleCounted, or hide a gradient nobody holds. Out of the step.
                    logger.warning("pipeline step %d: stage %d replica %s claims microbatches it was never sent; "
                                   "out of the step", self.step, stage, _name(peer))
                    self.wiring.leave_out(peer)
                    del held[peer]
                counts = collections.Counter(i for ids in held.values() for i in ids if i in self._microbatches)
                doubled = sorted(i for i, c in counts.items() if c > 1)
                if doubled:
                    raise DoubleCounted(f"stage {stage}: microbatches {doubled} are held by two replicas")
                missing = sorted(set(self._microbatches) - set(counts))
                if not missing:
                    rings[stage] = [p for p in self.wiring.replicas(stage) if p in held]
                    break
                for mb in missing:
                    liar = redone.get((stage, mb))
                    if liar is not None:
                        # It answered the redo and does not hold it: out of the step (redoing there
                        # again and again, a replica's lie would keep this loop going for ever).
                        logger.warning("pipeline step %d: stage %d replica %s answered microbatch %d and does "
                                       "not hold it; out of the step", self.step, stage, _name(liar), mb)
                        self.wiring.leave_out(liar)
                    redone[(stage, mb)] = await self._redo(stage, mb)
        self._judge_stalls()
        return rings

    async def _redo(self, stage: int, mb: int) -> Hashable:
        """Redo ``mb``'s hop at ``stage`` on a live replica; the replica that answered."""
        record = self._microbatches[mb]
        self.redone += 1
        logger.info("pipeline step %d: microbatch %d redone at stage %d", self.step, mb, stage)
        if stage == self.stage.count - 1:
            peer, _ = await self._answered(Kind.LOSS, stage, mb, (record.inputs[stage], record.targets), record.weight)
        else:
            peer, _ = await self._answered(Kind.BACKWARD, stage, mb, (record.inputs[stage], record.grads[stage]))
        return peer

    async def _holdings(self, stage: int) -> dict[Hashable, set[int]]:
        """{replica: microbatch ids it holds} of every replica of ``stage`` that answers in time."""
        held: dict[Hashable, set[int]] = {}
        request = encode_frame(Frame(Kind.HOLDINGS, self.step, 0, stage))
        mine = torch.tensor(sorted(self._microbatches), dtype=torch.int64)

        async def ask(peer: Hashable) -> None:
            began = self.clock()
            try:
                # Queued at the replica behind other drivers' hops: as long as one of them may take.
                with trio.fail_after(self.deadlines.deadline(stage, peer, 0)):
                    answer = await self._ask(peer, request, Kind.HOLDINGS, stage, 0, torch.empty(0))
                self.straggling.took(stage, peer, self.clock() - began)
            except (ChannelError, ActivationError, trio.TooSlowError, _BadAnswer) as error:
                if isinstance(error, trio.TooSlowError):
                    self.straggling.took(stage, peer, math.inf)
                logger.info("pipeline step %d: stage %d replica %s gave no holdings (%s); out of the step",
                            self.step, stage, _name(peer), str(error) or type(error).__name__)
                # Out of the stage's ring: a redo sent there would not be summed, and a replica
                # that answers hops but never its holdings would draw every redo, round after round.
                self.wiring.leave_out(peer)
                return
            # Only this driver's ids become Python objects: a replica may list millions of ids.
            ids = answer.tensors[0] if answer.tensors else torch.empty(0, dtype=torch.int64)
            held[peer] = set(ids[torch.isin(ids, mine)].tolist())

        async with trio.open_nursery() as nursery:
            for peer in self.wiring.replicas(stage):
                if not self.wiring.is_left_out(peer):
                    nursery.start_soon(ask, peer)
        return held


def _keep(
    record: _Microbatch, kind: Kind, stage: int, mb: int, tensors: tuple[torch.Tensor, ...], value: float,
    peer: Hashable, answer: Frame,
) -> None:
    """Keep a checked microbatch's hop for its second opinion (``kind``: how it is asked again)."""
    if record.hops is not None:
        record.hops.append(Hop(kind, stage, mb, tensors, value, peer, answer))


def _name(peer: Hashable) -> str:
    return short_id(peer) if isinstance(peer, ID) else str(peer)
