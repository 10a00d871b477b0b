"""One replica of one stage, serving the stage protocol (``/p2ptrain/pipeline/1.3.0``) on its host.

A replica needs nothing of a microbatch between requests (docs/pipeline.md): a BACKWARD carries the
stage's input again with the gradient of its output, so any replica can answer it by recomputing its
forward, and a sender can redo any hop elsewhere. What a replica *keeps* is an optimisation only: the
graph of its last few FORWARDs from each sender (``keep_graphs``, bounded, dropped at the next step),
so that the BACKWARD a driver sends back to the replica that served the FORWARD skips the recomputed
forward. A kept graph is used only for the same sender, step and microbatch id and a bitwise equal
input; anything else recomputes. The last stage keeps nothing (its FORWARD is a driver's integrity
check; its LOSS computes its own forward). The sender keeps what a hop needs until the step ends; a
replica that dies loses only what it computed.

A replica answers only the peers its plan names as senders (the drivers: only they send requests in
this protocol); any other peer's request is refused and counted (``outsider``), before its bytes are
read. It accumulates a microbatch's gradient into its parameters only *after* its answer went out,
and only once per (sender, microbatch id): a hop whose answer never left (the sender gave up and
reset the channel) leaves no trace, a sender that retries the same replica is answered without
counting twice, and a sender that uses another's (predictable) id adds its own gradient beside the
other's, never in its place. :meth:`held` says which microbatches of the step are in the replica's
gradients; each sender asks for its own at the end of a step (``HOLDINGS``: the answer lists only
the ids that sender sent) and redoes elsewhere what a dead replica took with it. A second opinion
(``CHECK_LOSS``, ``CHECK_BACKWARD``: a driver checking another replica's gradient) is computed as the
LOSS or BACKWARD it checks and answered the same way, but accumulates nothing and is held by nobody.

An evaluation (``EVAL``: a checkpoint's test-split metrics, pipeline/_evaluation.py) is a forward in
eval mode without a graph: the stage's output, or at the last stage the batch's mean loss and its
correct predictions (``SCORE``); it keeps and accumulates nothing, and is answered in fp32 whatever
the task's activation encoding, so that the metrics are the assembled model's. Besides the senders,
the plan's ``evaluators`` (the coordinator, which may serve another stage) are answered, EVAL only,
and an EVAL only from them: a sender's would be a forward of the eval batch, which its microbatch's
shapes do not bound (pipeline/_request_shapes.py).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Collection, Hashable

import torch
from torch import nn
import trio
from libp2p.abc import IHost

from p2ptrain.base import count_rejection, short_id
from p2ptrain.net import Channel, ChannelClosed, serve_channels, StreamGuard
from p2ptrain.pipeline._partition import Stage
from p2ptrain.pipeline._request_shapes import RequestShapes
from p2ptrain.wire.activations import ActivationError, decode_frame, DEFAULT_LIMITS, encode_frame, Frame, Kind, Limits

logger = logging.getLogger(__name__)

# 1.1.0: a channel carries any number of requests, one at a time, each followed by its answer (1.0.0:
# one request per channel). 1.2.0: the second opinions on gradients (CHECK_LOSS, CHECK_BACKWARD), which
# a 1.1.0 replica refuses as unknown frames; the frames are otherwise the same (wire/activations.py, version 1).
# 1.3.0: evaluations (EVAL, answered OUTPUT or SCORE), which a 1.2.0 replica refuses as unknown frames.
PROTOCOL = "/p2ptrain/pipeline/1.3.0"
# How long a replica waits for a request's bytes once a sender opened a channel to it.
REQUEST_TIMEOUT_S = 30.0
# How long a replica waits for the next request on a channel it answered on: a sender reuses its
# channels across steps and plans (pipeline/_channels.py, which stops reusing one after half this).
IDLE_TIMEOUT_S = 120.0
# How long a request for the step after the replica's waits for the replica to start that step: a
# driver that finished a step starts the next while the replicas still sum and apply the last one.
AHEAD_WAIT_S = 10.0
# Requests one peer may have open at a replica at once: each may buffer a whole frame (up to
# Limits.max_frame_bytes()) before it waits for the stage's lock; a driver's microbatches in flight
# at one stage rarely exceed this, and a sender that opens more is reset, not buffered.
MAX_STREAMS_PER_PEER = 8
# What a driver's requests read and not yet answered may take at a replica: this many of its longest
# frames (RequestShapes.frame_bytes; an evaluator's EVALs: RequestShapes.budget). An honest driver has no
# more microbatches in flight (run/_stages.py IN_FLIGHT), one hop each at a time, nor second opinions
# (_opinions.py CHECKS_IN_FLIGHT); past it a request is refused unread (StageReplica.reserve).
IN_FLIGHT_PER_PEER = 4
# Graphs of FORWARDs a replica keeps per sender for the BACKWARD that may come back to it: the
# runtime's microbatches in flight per driver (run/_stages.py IN_FLIGHT). Each holds the stage's
# saved activations for one microbatch; the oldest is dropped first.
KEEP_GRAPHS = 4

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# A FORWARD's graph kept for its BACKWARD: the input as sent, the graph's input leaf, its output.
_Graph = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class StageReplica:
    """Serves ``stage`` on ``host``: forward, loss (last stage), backward, and what it holds.

    ``loss(logits, targets)`` is the step's mean loss of one microbatch (the last stage's job);
    ``senders`` are the peers whose requests it answers (the plan's drivers), from the plan, never
    from a request; ``encoding`` is how its answers' activations and gradients travel (fp32, fp16, int8);
    ``keep_graphs``: FORWARD graphs kept per sender for its BACKWARDs (0: every BACKWARD recomputes);
    ``evaluators``: peers (from the plan too) whose EVAL requests it answers (nobody else's), and nothing else of theirs;
    ``shapes``: the task's shapes of its requests (pipeline/_request_shapes.py), which then set its
    frame limits too; a request of other shapes is refused before it is computed (None: any within ``limits``).
    """

    def __init__(
        self, host: IHost, stage: Stage, loss: Loss, *, senders: Collection[Hashable], encoding: str = "fp32",
        limits: Limits = DEFAULT_LIMITS, protocol: str = PROTOCOL, keep_graphs: int = KEEP_GRAPHS,
        evaluators: Collection[Hashable] = (), shapes: RequestShapes | None = None,
    ) -> None:
        self.host, self.stage, self.loss = host, stage, loss
        self.senders = frozenset(senders)
        self.evaluators = frozenset(evaluators)
        self.encoding, self.protocol, self.shapes = encoding, protocol, shapes
        self.limits = shapes.limits() if shapes is not None else limits
        self.step = 0
        # The step the stage's weights are at (the runtime sets it as it applies a step): what an
        # EVAL must name, since it evaluates the weights as they are, between steps or within one.
        self.weights_step = 0
        self._stepped = trio.Event()  # set (and replaced) by new_step
        self._held: dict[Hashable, set[int]] = {}  # {sender: microbatch ids whose gradients are in the stage's}
        self.keep_graphs = keep_graphs if stage.index < stage.count - 1 else 0
        # {sender: {(step, microbatch id): (its input, the input leaf of the graph, the output)}},
        # oldest first; read and written by the computation (under the lock), cleared by new_step.
        self._graphs: dict[Hashable, collections.OrderedDict[tuple[int, int], _Graph]] = {}
        self.reused = 0  # BACKWARDs answered from a kept graph
        self._lock = trio.Lock()  # one computation at a time: the stage's weights and grads are shared
        self._progress = trio.Event()
        self.requests = 0
        self.evaluations = 0  # EVAL requests answered
        # Requests refused, by reason: "outsider" (a peer the plan names no sender), "malformed" (bytes
        # or fields), "shape" (tensors not of the task's shapes: more samples than its microbatch, say),
        # "failed" (tensors the stage cannot take), "slow" (no whole request in time).
        # "oversized" (a frame longer than that peer's requests), "over_budget" (past its bytes in flight).
        self.refused: collections.Counter[str] = collections.Counter()
        self.guard: StreamGuard | None = None
        self._in_flight: collections.Counter[Hashable] = collections.Counter()  # {peer: bytes read, not answered}

    def serve(self) -> StreamGuard:
        """Start answering the stage protocol on the host; returns the stream guard (its counters)."""
        self.guard = serve_channels(self.host, self.protocol, self.answer, max_streams_per_peer=MAX_STREAMS_PER_PEER)
        return self.guard

    def new_step(self, step: int) -> None:
        """Start ``step`` (-1: none, the last applied: requests wait for the next): gradients zeroed, nothing held."""
        self.step = step
        self._held.clear()
        self._graphs.clear()
        for p in self.stage.parameters():
            p.grad = None
        self._stepped.set()
        self._stepped = trio.Event()

    def held(self, sender: Hashable | None = None) -> set[int]:
        """The microbatch ids of this step whose gradients are in this replica's parameters: those
        ``sender`` sent, or (None) those of every sender."""
        if sender is not None:
            return set(self._held.get(sender, ()))
        return {mb for ids in self._held.values() for mb in ids}

    async def held_at_least(self, count: int) -> None:
        """Return once ``count`` microbatches are held (for tests and benches that act mid-step)."""
        while sum(len(ids) for ids in self._held.values()) < count:
            await self._progress.wait()

    async def answer(self, channel: Channel) -> None:
        """Answer the requests on ``channel`` until its sender closes it (what :meth:`serve` runs for
        every channel; a runtime that serves several stages in turn on one host runs
        :func:`serve_requests` with its current replica)."""
        await serve_requests(channel, lambda: self)

    async def admitted(self, channel: Channel) -> bool:
        """Whether ``channel``'s peer is one of this replica's senders or evaluators; if not, the
        refusal is counted (``outsider``) and the channel reset."""
        if channel.remote_peer in self.senders or channel.remote_peer in self.evaluators:
            return True
        count_rejection(self.refused, "outsider", logger, logging.INFO, "pipeline stage %d: refused a request "
                        "from %s, which the plan names no sender", self.stage.index, short_id(channel.remote_peer))
        await channel.reset()
        return False

    def frame_bound(self, peer: Hashable) -> int:
        """The longest request frame ``peer`` may send: its roles' largest request (a sender's, an
        evaluator's, or both: pipeline/_request_shapes.py), or the frame limits where no shapes are set."""
        if self.shapes is None:
            return self.limits.max_frame_bytes()
        return self.shapes.frame_bytes(sender=peer in self.senders, evaluator=peer in self.evaluators)

    async def reserve(self, channel: Channel, length: int) -> bool:
        """Whether the request ``channel``'s peer announced at ``length`` bytes may be read: within its
        frames (else ``oversized``) and, with its requests read and not yet answered, its budget
        (``RequestShapes.budget``; else ``over_budget``), the others' their own. Refused: counted,
        logged, the channel reset; taken: it counts against its peer until :meth:`release`."""
        peer, bound = channel.remote_peer, self.frame_bound(channel.remote_peer)
        budget = IN_FLIGHT_PER_PEER * bound if self.shapes is None else self.shapes.budget(
            IN_FLIGHT_PER_PEER, sender=peer in self.senders, evaluator=peer in self.evaluators)
        held = self._in_flight[peer]
        if length <= bound and held + length <= budget:
            self._in_flight[peer] += length
            return True
        reason, why = ("oversized", f"its requests take at most {bound}") if length > bound else \
            ("over_budget", f"{held} bytes of its requests are in flight, at most {budget}")
        count_rejection(self.refused, reason, logger, logging.INFO, "pipeline stage %d: refused a request of %d bytes "
                        "from %s: %s", self.stage.index, length, short_id(peer), why)
        await channel.reset()
        return False

    def release(self, peer: Hashable, length: int) -> None:
        """``peer``'s request of ``length`` bytes (:meth:`reserve`) was answered or refused."""
        self._in_flight[peer] -= length
        if not self._in_flight[peer]:
            del self._in_flight[peer]

    async def handle(self, channel: Channel, data: bytes) -> bool:
        """Answer the request ``data`` that came on ``channel`` from an admitted sender; False when
        it was refused (counted, and the channel reset)."""
        sender = channel.remote_peer
        try:
            request = decode_frame(data, self.limits)
            misshapen = self._misshapen(request)
            if misshapen:
                count_rejection(self.refused, "shape", logger, logging.INFO, "pipeline stage %d: refused a request "
                                "from %s: %s", self.stage.index, short_id(sender), misshapen)
                await channel.reset()
                return False
            # A driver already in the next step: wait for ours to start (an EVAL names the weights' step).
            if request.kind != Kind.EVAL and request.step > self.step:
                with trio.move_on_after(AHEAD_WAIT_S):
                    while request.step > self.step:
                        await self._stepped.wait()
            problem = self._problem(request)
        except ActivationError as error:
            problem = str(error)
        # An evaluator sends EVALs only, and only an evaluator does: a driver's EVAL (up to the eval
        # batch, not its microbatch) would be a FORWARD the request shapes do not bound.
        if not problem and sender not in (self.evaluators if request.kind == Kind.EVAL else self.senders):
            count_rejection(self.refused, "outsider", logger, logging.INFO, "pipeline stage %d: refused a %s request "
                            "from %s, %s", self.stage.index, Kind(request.kind).name, short_id(sender),
                            "a sender only" if request.kind == Kind.EVAL else "an evaluator only")
            await channel.reset()
            return False
        if problem:
            count_rejection(self.refused, "malformed", logger, logging.INFO, "pipeline stage %d: refused a request "
                            "from %s: %s", self.stage.index, short_id(sender), problem)
            await channel.reset()
            return False
        self.requests += 1
        async with self._lock:
            try:
                answer, grads = await trio.to_thread.run_sync(self._compute, request, sender)
                # An evaluation's answer in fp32: the metrics are then the assembled model's.
                data = encode_frame(answer, "fp32" if request.kind == Kind.EVAL else self.encoding)
            except (ActivationError, AssertionError, RuntimeError, ValueError, IndexError) as error:
                # A tensor this stage cannot take (wrong width or rank, a token id past the
                # vocabulary, a gradient of the wrong shape, targets that make the loss NaN; torch's
                # attention asserts its input's rank): the sender's fault, refused like malformed bytes.
                count_rejection(self.refused, "failed", logger, logging.INFO, "pipeline stage %d: a request "
                                "from %s failed: %s", self.stage.index, short_id(sender), error)
                await channel.reset()
                return False
            # Sent before anything is accumulated: a hop whose answer never left leaves no trace.
            await channel.send(data)
            if request.kind == Kind.EVAL:
                self.evaluations += 1
                return True
            held = self._held.setdefault(sender, set())
            if grads is not None and request.microbatch not in held:
                for p, g in zip(self.stage.parameters(), grads, strict=True):
                    p.grad = g if p.grad is None else p.grad.add_(g)
                held.add(request.microbatch)
                self._progress.set()
                self._progress = trio.Event()
        return True

    def _misshapen(self, request: Frame) -> str | None:
        """Why ``request``'s tensors are not of the task's shapes (None: they are, or none are set),
        asked of a request of a kind and number of tensors this replica answers only."""
        if self.shapes is None or self._no_request(request):
            return None
        return self.shapes.problem(request)

    def _no_request(self, request: Frame) -> str | None:
        """Why ``request`` is of no kind, or number of tensors, this replica answers; or None."""
        last = self.stage.index == self.stage.count - 1
        expected: dict[int, int] = {Kind.FORWARD: 1, Kind.LOSS: 2, Kind.BACKWARD: 2, Kind.HOLDINGS: 0,
                                    Kind.CHECK_LOSS: 2, Kind.CHECK_BACKWARD: 2, Kind.EVAL: 2 if last else 1}
        if request.kind not in expected or len(request.tensors) != expected[request.kind]:
            return f"a {request.kind} frame with {len(request.tensors)} tensors is no request"
        return None

    def _problem(self, request: Frame) -> str | None:
        """Why ``request`` is not one this replica answers, or None."""
        no_request = self._no_request(request)
        if no_request:
            return no_request
        last = self.stage.index == self.stage.count - 1
        step = self.weights_step if request.kind == Kind.EVAL else self.step
        if request.stage != self.stage.index or request.step != step:
            return f"request for stage {request.stage} step {request.step}; this is stage {self.stage.index} step {step}"
        loss = request.kind in (Kind.LOSS, Kind.CHECK_LOSS)
        if loss and not last:
            return "only the last stage computes the loss"
        if request.kind in (Kind.BACKWARD, Kind.CHECK_BACKWARD) and last:
            return "the last stage takes its gradient from the loss"
        if loss and not 0 < request.value <= 1:
            return f"a microbatch's weight in its step is in (0, 1], not {request.value}"
        return None

    def _compute(self, request: Frame, sender: Hashable) -> tuple[Frame, tuple[torch.Tensor, ...] | None]:
        """The answer to ``sender``'s ``request`` and, for LOSS and BACKWARD, the gradients of this
        stage's parameters (not yet accumulated; None for a second opinion, which accumulates nothing).
        Runs in a worker thread, under the replica's lock."""
        reply = Frame(Kind.GRAD, request.step, request.microbatch, request.stage)
        if request.kind == Kind.HOLDINGS:
            ids = torch.tensor(sorted(self._held.get(sender, ())), dtype=torch.int64)
            return Frame(Kind.HELD, request.step, 0, request.stage, tensors=(ids,) if len(ids) else ()), None
        if request.kind == Kind.EVAL:
            return self._evaluate(request), None
        x = request.tensors[0]
        key = (request.step, request.microbatch)
        if request.kind == Kind.FORWARD:
            if not (self.keep_graphs and x.is_floating_point()):
                with torch.no_grad():
                    out = self.stage(x)
                return Frame(Kind.OUTPUT, request.step, request.microbatch, request.stage, tensors=(out,)), None
            leaf = x.detach().requires_grad_()
            with torch.enable_grad():
                out = self.stage(leaf)
            graphs = self._graphs.setdefault(sender, collections.OrderedDict())
            graphs[key] = (x, leaf, out)
            while len(graphs) > self.keep_graphs:
                graphs.popitem(last=False)
            return Frame(Kind.OUTPUT, request.step, request.microbatch, request.stage, tensors=(out.detach(),)), None
        params = list(self.stage.parameters())
        sent = self._graphs.get(sender)
        backward = request.kind in (Kind.BACKWARD, Kind.CHECK_BACKWARD)
        kept = sent.pop(key, None) if sent is not None and backward else None
        if kept is not None and kept[0].dtype == x.dtype and torch.equal(kept[0], x):
            x, out = kept[1], kept[2]  # this sender's FORWARD of the same input: no second forward
            self.reused += 1
        else:
            x = x.requires_grad_(x.is_floating_point())
            with torch.enable_grad():
                out = self.stage(x)
        inputs = [x, *params] if x.requires_grad else params
        # A second opinion computes exactly what the request it checks computes (the parameters'
        # gradients too, then dropped): the input gradient must come out of the same kernels.
        with torch.enable_grad():
            if not backward:
                loss = self.loss(out, request.tensors[1])
                grads = torch.autograd.grad(loss * request.value, inputs)
                reply = Frame(Kind.GRAD, request.step, request.microbatch, request.stage, float(loss.detach()))
            else:
                if request.tensors[1].shape != out.shape:
                    raise ActivationError(
                        f"gradient of shape {tuple(request.tensors[1].shape)} for an output of {tuple(out.shape)}"
                    )
                grads = torch.autograd.grad(out, inputs, request.tensors[1])
        accumulated = None if request.kind in (Kind.CHECK_LOSS, Kind.CHECK_BACKWARD) else grads[1:] if x.requires_grad \
            else grads
        if x.requires_grad:
            return Frame(reply.kind, reply.step, reply.microbatch, reply.stage, reply.value, (grads[0],)), accumulated
        return reply, accumulated

    def _evaluate(self, request: Frame) -> Frame:
        """The answer to an EVAL: the stage's output in eval mode (the lock keeps any other
        computation out meanwhile), or at the last stage the SCORE of its targets (mean loss, and the
        correct predictions among how many)."""
        out = eval_forward(self.stage, request.tensors[0])
        if self.stage.index < self.stage.count - 1:
            return Frame(Kind.OUTPUT, request.step, request.microbatch, request.stage, tensors=(out,))
        targets = request.tensors[1]
        loss, hits = eval_score(out, targets, self.loss)
        score = torch.tensor([hits, targets.numel()], dtype=torch.int64)
        return Frame(Kind.SCORE, request.step, request.microbatch, request.stage, loss, (score,))


def eval_forward(stage: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``stage``'s output for ``x`` in eval mode with no graph, its training mode restored after: an
    evaluation's hop, here or at a replica (pipeline/_evaluation.py)."""
    training = stage.training
    stage.eval()
    try:
        with torch.no_grad():
            out: torch.Tensor = stage(x)
            return out
    finally:
        stage.train(training)


def eval_score(out: torch.Tensor, targets: torch.Tensor, loss: Loss) -> tuple[float, int]:
    """The last stage's mean ``loss`` and correct predictions for its evaluated output ``out``."""
    with torch.no_grad():
        hits = int((out.reshape(-1, out.shape[-1]).argmax(-1) == targets.reshape(-1)).sum())
        return float(loss(out, targets)), hits


async def serve_requests(channel: Channel, current: Callable[[], StageReplica | None]) -> None:
    """Answer a sender's requests on ``channel``, one after another, each by the replica ``current()``
    names when the request has arrived (a runtime's replica changes with its plans; None: this host
    serves no stage now, and the channel is reset), until the sender closes the channel, a request is
    refused (the channel is reset) or no request comes for :data:`IDLE_TIMEOUT_S` (the channel is
    closed). A sender that is no sender of the replica is refused before any of its bytes are read.

    The first request's header must arrive within :data:`REQUEST_TIMEOUT_S` (else ``slow``, counted),
    each later one's within :data:`IDLE_TIMEOUT_S` of the answer before it (a channel idles between
    steps), each body within :data:`REQUEST_TIMEOUT_S` of its header, read only once its announced
    length fits its peer's frames and budget (:meth:`StageReplica.reserve`)."""
    replica = current()
    if replica is None:
        await channel.reset()
        return
    if not await replica.admitted(channel):
        return
    first = True
    while True:
        length = None
        with trio.move_on_after(REQUEST_TIMEOUT_S if first else IDLE_TIMEOUT_S):
            try:
                length = await channel.announced()
            except ChannelClosed:
                if first:
                    raise
                return  # the sender closed its channel between requests: it is done with it
        if length is None:
            if not first:
                return  # idle: serve_channels closes the channel; the sender no longer reuses it by then
            count_rejection(replica.refused, "slow", logger, logging.INFO, "pipeline stage %d: no request from %s "
                            "within %.0f s", replica.stage.index, short_id(channel.remote_peer), REQUEST_TIMEOUT_S)
            await channel.reset()
            return
        replica = current()
        if replica is None:
            await channel.reset()
            return
        if not await replica.admitted(channel) or not await replica.reserve(channel, length):
            return
        try:
            if not await _answer_one(channel, replica, length):
                return
        finally:
            replica.release(channel.remote_peer, length)
        first = False


async def _answer_one(channel: Channel, replica: StageReplica, length: int) -> bool:
    """Read the request whose header announced ``length`` bytes (within :data:`REQUEST_TIMEOUT_S`,
    else ``slow``, counted) and have ``replica`` answer it; False when the channel is done."""
    data = None
    with trio.move_on_after(REQUEST_TIMEOUT_S):
        data = await channel.recv(length)
    if data is None:
        count_rejection(replica.refused, "slow", logger, logging.INFO, "pipeline stage %d: no whole request from %s "
                        "within %.0f s of its header", replica.stage.index, short_id(channel.remote_peer),
                        REQUEST_TIMEOUT_S)
        await channel.reset()
        return False
    return await replica.handle(channel, data)
