"""``p2ptrain.Optimizer``: the user's own module, trained from the user's own loop, across peers.

::

    opt = p2ptrain.Optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), model=model,
                             run="my-run", bootstrap=[...], home=..., mode="sync",
                             density=0.01, quantize=None, robust="none", checkpoint_every=50, min_peers=2)
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    opt.model_cid   # the latest confirmed (signed, attested) model CID
    opt.close()

Everything a node-run task has works the same: the sparse ring with error feedback (or local-SGD
with quantized pseudo-gradients), robust clip, elections, signed and attested model CIDs, late
joiners (they load the run's head by CID into their own module), dead peers, NATs, metrics. What is
different: no code and no task file cross the network. Every member runs the same script; the run is
its name plus the architecture card of its module, optimizer and options (models/_fingerprint.py),
and a member whose model or options differ is refused with the first difference (_rendezvous.py).

``step()`` hands this member's gradient to the run's round and returns once the identical step of
the run is applied here (bitwise the same weights on every member). Between steps the model is the
user's. Buffers (BatchNorm's running statistics) are the member's own during a span and averaged
over the span's members at each checkpoint, so the checkpoint every member hashes is the same.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from p2ptrain.api._arguments import address_list, check_inputs
from p2ptrain.api._background import BackgroundPeer
from p2ptrain.api._rendezvous import JOIN_WINDOW_S, choose_run, keep_announcing, load_initial, store_own
from p2ptrain.base import (ArgumentError, UserError, all_finite, default_home, flat_params, load_flat_params,
                           load_or_create_identity, peer_id_of)
from p2ptrain.ipfs import open_store
from p2ptrain.services import parse_address
from p2ptrain.control import FINISHED, TaskStatus, is_live, socket_path
from p2ptrain.node import NodeConfig
from p2ptrain.models import card_bytes, card_of
from p2ptrain.protocol import load_model_bytes, model_bytes
from p2ptrain.task import USER_MODEL, Task, parse_task
from p2ptrain.training import (
    GradientBridge, StepSkipped, Trainer, UserLocalSGDTrainer, UserTrainer, module_device, slow_on_sparse,
)

log = logging.getLogger(__name__)

MODES = ("sync", "local_sgd")
# A run with no length given runs for this many steps: as long as its members keep stepping.
UNBOUNDED_STEPS = 10**9
# While step() waits for the run (fewer than min_peers members, an election), it says why this often.
WAIT_REPORT_S = 15.0
# The constructor returns once this member holds the run's state: its initial weights, or, in a run
# under way, its head loaded by CID (a large model over a slow link takes a while).
READY_TIMEOUT_S = 600.0


class RunFinished(UserError):
    """The run reached its last step: there is no step to take part in any more."""


class Optimizer:
    """Wraps ``optimizer`` (any ``torch.optim.Optimizer`` over ``model``'s parameters) so that each
    ``step()`` is one step of the run named ``run``, identical on every member (see the module).

    ``bootstrap``: addresses of peers of the mesh (``/ip4/…/tcp/…/p2p/…``); ``home``: this peer's
    home (identity, store; default ``runs/<run>`` under ``$P2PTRAIN_HOME`` or ``~/.p2ptrain``);
    ``listen``: where it listens (default loopback; give this machine's address for peers
    elsewhere; a port in use is refused). ``mode="local_sgd"`` with ``inner_steps=H``: ``step()``
    is an inner step, every H-th one an outer step over the members. ``density``, ``quantize``
    (None, "int8", "2bit"), ``robust`` ("none", "clip"): the round's compression and defence, as a
    task's ``[compression]``. ``outer_optimizer`` ("nesterov", DiLoCo's, or "average": the members'
    mean, as FedAvg), ``outer_lr``, ``outer_momentum``: local-SGD's outer step. ``checkpoint_every``:
    steps between confirmed models. ``min_peers``/``max_peers``: members a step needs / admits.
    ``total_steps``: the run's length (None: as long as members step). ``evaluate(model) -> {"accuracy": …,
    "loss": …}``: the metrics recorded with each checkpoint (this member's, when it coordinates).
    ``metrics``: ``HOST:PORT`` of a Prometheus endpoint for this member's node (as ``node start
    --metrics``). ``node_config``: every other setting of this member's node (NAT, relays, rates: a
    :class:`~p2ptrain.node.NodeConfig`, as ``node start`` takes them); ``listen`` and ``bootstrap``
    override its own."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        model: nn.Module,
        run: str,
        bootstrap: Sequence[str] = (),
        home: str | Path | None = None,
        listen: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
        mode: str = "sync",
        inner_steps: int | None = None,
        density: float = 0.01,
        quantize: str | None = None,
        robust: str = "none",
        checkpoint_every: int = 50,
        min_peers: int = 2,
        max_peers: int = 64,
        total_steps: int | None = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_optimizer: str = "nesterov",
        allow: Sequence[str] | None = None,
        publisher: str | None = None,
        evaluate: Callable[[nn.Module], dict[str, float]] | None = None,
        metrics: str | None = None,
        node_config: NodeConfig | None = None,
        join_window_s: float = JOIN_WINDOW_S,
        ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> None:
        check_inputs(optimizer, model, run)  # a state dict as model=, a number as run=: one line, here
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        if (mode == "local_sgd") != (inner_steps is not None):
            raise ValueError('inner_steps goes with mode="local_sgd" (and it needs one)')
        self.optimizer = optimizer
        self.model = model
        self._allow = frozenset(allow) if allow is not None else None
        if slow_on_sparse(optimizer, density):
            log.warning("run %r: %s without fused=True takes up to 2x longer per step on sparse averages; "
                        "pass fused=True", run, type(optimizer).__name__)
        self.run = run
        self.mode = mode
        self.inner_steps = inner_steps
        self._params = [p for p in model.parameters()]
        options = {"mode": mode, "inner_steps": inner_steps, "density": density, "quantize": quantize,
                   "robust": robust, "checkpoint_every": checkpoint_every, "min_peers": min_peers,
                   "max_peers": max_peers, "total_steps": total_steps or UNBOUNDED_STEPS,
                   "allow": sorted(allow) if allow is not None else None,
                   "buffers": "averaged at each checkpoint"}
        if mode == "local_sgd":
            options.update(outer_optimizer=outer_optimizer)
            if outer_optimizer == "nesterov":  # "average" takes no rate or momentum
                options.update(outer_lr=outer_lr, outer_momentum=outer_momentum)
        self._card = card_of(model, optimizer, options)  # CardError (a ValueError) for a model it cannot describe
        card = card_bytes(self._card)
        home = Path(home).expanduser() if home is not None else default_home() / "runs" / _safe(run)
        if socket_path(home).exists() and is_live(socket_path(home)):  # not the file a killed script left
            # home= to a script, --home to a command line (an example's): as the user spelt it.
            raise ArgumentError("a p2ptrain node runs on {path}: each member running at once needs a home of its own; "
                                "pass another {home:DIR}", path=home)
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        store = open_store(home)
        architecture = str(store.add_bytes(card, only_hash=True))
        self._user_card = {"name": USER_MODEL, "kwargs": {"architecture": architecture}}
        initial = str(store.add_bytes(model_bytes(model, self._user_card), only_hash=True))
        if publisher is None:  # who may cancel the run: the member whose task is taken, unless told
            publisher = peer_id_of(load_or_create_identity(home)).to_base58()
        # A model on a GPU makes a task that needs CUDA: members attest each other's bits, and a CPU
        # member's steps round differently, so CPU and GPU members of one script meet in two runs.
        on_gpu = module_device(model).type == "cuda"  # where the run's trainer finds the model too
        task = _task(run, architecture, initial, options, allow, publisher, device="cuda" if on_gpu else None)
        self.bridge = GradientBridge()
        self._evaluate = evaluate
        self._inner = 0  # local-SGD: inner steps taken since the last outer step
        self._theta: torch.Tensor | None = None  # local-SGD: the shared weights the inner steps started from
        self._closed = False
        self._left: TaskStatus | None = None  # the run's status when this member left (close)
        self._bootstrap = address_list("bootstrap", bootstrap)
        config = replace(node_config or NodeConfig(), listen=address_list("listen", listen), bootstrap=self._bootstrap)
        metrics_at = parse_address(metrics) if metrics is not None else None
        self._peer = BackgroundPeer(home, config, metrics_at=metrics_at)
        try:
            self.run_cid = self._peer.call(self._join, task, card, join_window_s)
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self._peer.close()
            raise
        # From here on the model is the user's between steps (training/_user_trainer.py, GradientBridge).
        self.bridge.model_lock.acquire()

    # -- joining (in the peer's thread) --------------------------------------------------------

    async def _join(self, task: Task, card: bytes, window: float) -> str:
        peer = self._peer.peer
        assert peer is not None
        own = await store_own(peer, task, card, self.model, self._user_card)
        chosen = await choose_run(peer, self.run, own, self._card, window, expect_peers=bool(self._bootstrap),
                                  allow=self._allow)
        if not chosen.own:
            await load_initial(peer, chosen.task, self.model)  # every member starts from the same bits
        task = chosen.task
        peer.tasks.bindings[chosen.task_cid] = lambda total_steps: self._make_trainer(task, total_steps)
        await peer.tasks.join(chosen.task_cid)
        self._peer.start_soon(keep_announcing, peer, self.run, chosen.task_cid)
        log.info("run %r: taking part as %s in %s (%s)", self.run, peer.node.peer_id.to_base58(), chosen.task_cid,
                 "its first member" if chosen.own else "it was under way or announced first")
        return chosen.task_cid

    def _wait_ready(self, timeout: float) -> None:
        """Until this member holds the run's state (the run prepared, and a run under way's head
        loaded into the module): the user's loop may not touch the model before."""
        deadline = time.monotonic() + timeout
        last_report = time.monotonic()
        while True:
            status = self.status()
            if status.synced:
                return
            if status.state in {phase.value for phase in FINISHED}:
                if status.state == "done":
                    raise RunFinished(f"run {self.run!r} is over already ({status.total_steps} steps); its model is "
                                      f"{status.latest_model_cid}")
                raise UserError(f"run {self.run!r}: {status.state} {status.error or ''}".rstrip())
            if time.monotonic() >= deadline:
                raise UserError(f"run {self.run!r}: this member did not get the run's state within {timeout:.0f} s "
                                f"({status.state})")
            if time.monotonic() - last_report >= WAIT_REPORT_S:
                last_report = time.monotonic()
                log.info("run %r: getting the run's state (%s)", self.run, status.state)
            time.sleep(0.1)

    def _make_trainer(self, task: Task, total_steps: int) -> Trainer:
        """The run's trainer over this member's module (called by the run, in the peer's thread)."""
        if self.mode == "local_sgd":
            return UserLocalSGDTrainer(task, self.model, self.optimizer, self.bridge, total_steps=total_steps,
                                       evaluate=self._evaluate)
        return UserTrainer(task, self.model, self.optimizer, self.bridge, total_steps=total_steps,
                           evaluate=self._evaluate)

    # -- the user's loop -------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None, *, loss: float | torch.Tensor | None = None) -> Any:
        """One step of the run with this member's gradients (call after ``loss.backward()``).

        Nothing is sent when a gradient is missing (a ``step()`` before ``backward()``) or not
        finite: one error says which, and the weights stay as they were. Returns the closure's loss
        (or ``loss``) like ``torch.optim.Optimizer.step``."""
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._closed:
            raise UserError(f"run {self.run!r}: this p2ptrain.Optimizer is closed")
        grads = [p.grad for p in self._params]
        if all(g is None for g in grads):
            raise RuntimeError("step() before backward(): no parameter has a gradient (call loss.backward() "
                               "first); nothing was sent")
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss) if loss is not None else math.nan
        if self.mode == "local_sgd":
            self._inner_step(value)
        else:
            flat = self._flat_grad(grads)
            self._round(flat, value)
        return loss

    def _flat_grad(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        flat = torch.cat([(g if g is not None else torch.zeros_like(p)).detach().reshape(-1).float().cpu()
                          for g, p in zip(grads, self._params)])
        if not all_finite(flat):
            names = [n for n, p in self.model.named_parameters() if p.grad is not None and not all_finite(p.grad)]
            raise FloatingPointError(f"the gradient of {names[0] if names else 'a parameter'} is not finite at step "
                                     f"{self.step_count}: nothing was sent and the weights are unchanged (skip this "
                                     "batch, or lower the learning rate)")
        return flat

    def _inner_step(self, loss: float) -> None:
        """Local-SGD: the user's optimizer takes the inner step here; the H-th hands the pseudo-gradient
        (the shared weights minus the weights after H inner steps) to the run's outer round."""
        assert self.inner_steps is not None
        self._flat_grad([p.grad for p in self._params])  # a non-finite gradient is refused before it is applied
        if self._theta is None:
            self._theta = self._weights()
        self.optimizer.step()
        self._inner += 1
        if self._inner < self.inner_steps:
            return
        delta = self._theta - self._weights()
        self._set_weights(self._theta)  # the outer step starts from the shared weights, as on every member
        self._inner = 0
        try:
            self._round(delta, loss)
        finally:
            self._theta = None  # the next inner loop starts from the weights the run holds now

    def _round(self, flat: torch.Tensor, loss: float) -> None:
        ticket = self.bridge.submit(flat, loss)
        last_report = started = time.monotonic()
        while True:
            try:
                self.bridge.wait(ticket, timeout=1.0)
                return
            except TimeoutError:
                pass
            except StepSkipped as exc:
                log.info("run %r: %s", self.run, exc)
                return
            status = self.status()
            if status.state in {phase.value for phase in FINISHED}:
                if status.state == "done":
                    self._hold_final(status)
                    raise RunFinished(f"run {self.run!r} reached its last step ({status.total_steps}); its model is "
                                      f"{status.latest_model_cid}")
                raise UserError(f"run {self.run!r} stopped: {status.state} {status.error or ''}".rstrip())
            if time.monotonic() - last_report >= WAIT_REPORT_S:
                # Missing members: the wait a user acts on, said once a wait where default logging shows it.
                loud, last_report = status.waiting_for_peers > 0 and last_report == started, time.monotonic()
                (log.warning if loud else log.info)("run %r: step %d waits for the run (%s)", self.run, self.step_count,
                                                    _why_waiting(status, self.addresses[:1] if loud else []))

    def _hold_final(self, status: TaskStatus) -> None:
        """The run is over: the module takes the run's final model (the step just asked for was
        computed from it, but its forward pass moved the buffers: BatchNorm's running statistics)."""
        if status.latest_model_cid is None:
            return
        store = open_store(self._peer.home)
        load_model_bytes(self.model, store.cat(status.latest_model_cid))

    def _weights(self) -> torch.Tensor:
        return flat_params(self._params)

    def _set_weights(self, flat: torch.Tensor) -> None:
        load_flat_params(self._params, flat)

    # -- what the run is doing --------------------------------------------------------------------

    def status(self) -> TaskStatus:
        """This member's ``task status`` of the run; after ``close()``, as it was then (``model_cid``...)."""
        if self._left is not None:
            return self._left
        def read() -> TaskStatus:
            peer = self._peer.peer
            assert peer is not None
            return peer.tasks.runs[self.run_cid].status()

        return self._peer.call_soon(read)  # type: ignore[no-any-return]

    @property
    def model_cid(self) -> str | None:
        """The latest confirmed (signed, attested) model of the run, None before the first."""
        status = self.status()
        return status.latest_model_cid if status.version else None

    @property
    def step_count(self) -> int:
        """The run's steps this member holds (outer steps in local-SGD mode)."""
        return self.status().step

    @property
    def peer_id(self) -> str:
        """This member's peer ID."""
        assert self._peer.peer is not None
        return self._peer.peer.node.peer_id.to_base58()

    @property
    def addresses(self) -> list[str]:
        """Where this member listens, with its peer ID: what another member passes as ``bootstrap``."""
        peer = self._peer.peer
        assert peer is not None
        return self._peer.call_soon(lambda: list(peer.node.addrs))  # type: ignore[no-any-return]

    @property
    def peers(self) -> tuple[str, ...]:
        """The members of the run's current span (peer IDs)."""
        return self.status().members

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def wait_confirmed(self, step: int, timeout: float = 120.0) -> str:
        """Block until the run confirmed a model at ``step`` or later; its CID."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if status.chain and status.chain[-1].step >= step:
                return status.chain[-1].model_cid
            if time.monotonic() >= deadline:
                raise TimeoutError(f"run {self.run!r}: no model confirmed at step {step} within {timeout:.0f} s "
                                   f"({_why_waiting(status)})")
            time.sleep(0.2)

    # -- the end -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the run: this member's node says goodbye and stops (the run goes on with the
        others); idempotent. The home keeps the run's chain and models."""
        if self._closed:
            return
        self._left = self.status() if self._peer.running else None
        self._closed = True
        self.bridge.close("this member left the run")
        if self.bridge.model_lock.locked():
            self.bridge.model_lock.release()  # the run may still need it to finish what it does
        self._peer.close()

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _task(run: str, architecture: str, initial: str, options: dict[str, Any], allow: Sequence[str] | None,
          publisher: str | None, device: str | None = None) -> Task:
    """The task this member would publish for the run (the same bytes on every member with the same
    script, but for the initial weights: see p2ptrain.api._rendezvous). ``device``: ``"cuda"`` for a
    model on a GPU (``[requirements] device``); None: the CPU, the default."""
    compression: dict[str, Any] = {"density": options["density"], "robust": options["robust"]}
    if options["quantize"] is not None:
        compression["values"] = options["quantize"]
    training: dict[str, Any] = {"batch_size": 1, "total_steps": options["total_steps"],
                                "checkpoint_interval": options["checkpoint_every"]}
    peers: dict[str, Any] = {"min": options["min_peers"], "max": options["max_peers"]}
    if allow is not None:
        peers.update(admission="allowlist", allow=list(allow))
    data: dict[str, Any] = {"name": run, "initial_model": initial, "training": training, "compression": compression,
                            "peers": peers, "model": {"name": USER_MODEL, "architecture": architecture}}
    if options["mode"] == "local_sgd":
        training.update(mode="local_sgd", inner_steps=options["inner_steps"])
        data["outer"] = {"optimizer": options["outer_optimizer"]}
        if "outer_lr" in options:
            data["outer"].update(lr=options["outer_lr"], momentum=options["outer_momentum"])
    if publisher is not None:
        data["publisher"] = publisher
    if device is not None:
        data["requirements"] = {"device": device}
    try:
        return parse_task(data)
    except UserError as exc:  # an option out of its range: say which, as the task file would
        raise ValueError(f"p2ptrain.Optimizer option: {exc}") from None


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64] or "run"


def _why_waiting(status: TaskStatus, reach: list[str] | None = None) -> str:
    if status.waiting_for_peers:
        return f"waiting for {status.waiting_for_peers} more peer(s)" + "".join(f"; they bootstrap from {a}" for a in reach or [])
    if status.coordinator is None:
        return "no coordinator elected yet"
    return f"state {status.state}, {len(status.members)} member(s) in the span"
