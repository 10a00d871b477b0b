"""Dynamic batching: requests queue, one loop runs them through the model in batches.

Why: a forward over 64 samples costs far less than 64 forwards of one (one matrix product instead of
64, one thread hop, one lock), so under concurrent load the server gathers what is queued, up to
``max_batch`` samples, waiting at most ``max_wait_s`` for more after the first, and runs one forward.
With ``max_batch=1`` every request is its own forward (the bench's "no batching" case).

The model in use is one :class:`Loaded` (module, CID, what ``GET /model`` tells). :meth:`swap` replaces
it between batches: a batch already taken runs on the model it started with and its answers name that
CID, so a head swap under load drops and mixes nothing.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import trio
from torch import nn

from p2ptrain.serve._input_spec import InputSpec

logger = logging.getLogger(__name__)

# Requests waiting for a batch: at the bench's ~200 req/s, five seconds of backlog. One more is
# answered 503 (busy, retry) instead of growing memory without end.
MAX_QUEUED_REQUESTS = 1024
# Samples waiting for a batch, over all queued requests: 65,536 samples of 784 float32 (MNIST-sized)
# are 205 MB, the most the queue holds whatever the requests' sizes; past it, 503.
MAX_QUEUED_SAMPLES = 65_536


class Busy(Exception):
    """The queue is full; the HTTP layer answers 503."""


@dataclass(frozen=True)
class Loaded:
    """A model ready to serve: the module (eval mode, on ``device``), its CID, what its inputs must be
    (an :class:`~p2ptrain.serve._input_spec.InputSpec`) and its description for ``GET /model``."""

    module: nn.Module
    cid: str
    spec: InputSpec
    info: dict[str, Any]
    device: torch.device


@dataclass
class _Pending:
    x: torch.Tensor
    done: trio.Event = field(default_factory=trio.Event)
    outputs: torch.Tensor | None = None
    cid: str = ""
    error: str = ""


def forward(loaded: Loaded, xs: list[torch.Tensor]) -> torch.Tensor:
    """One forward over the concatenated samples of ``xs`` (run in a worker thread)."""
    with torch.inference_mode():
        x = xs[0] if len(xs) == 1 else torch.cat(xs)
        out: torch.Tensor = loaded.module(x.to(loaded.device)).to("cpu")
        return out


class Batcher:
    """Queue of requests and the loop (:meth:`run`) that answers them in batches."""

    def __init__(self, loaded: Loaded, max_batch: int, max_wait_s: float) -> None:
        self.current = loaded
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.counts: Counter[str] = Counter()  # requests, samples, batches, failed
        self._send, self._recv = trio.open_memory_channel[_Pending](MAX_QUEUED_REQUESTS)
        self._carry: _Pending | None = None  # taken but over the batch: first of the next one
        self.queued_samples = 0

    def swap(self, loaded: Loaded) -> None:
        """Serve ``loaded`` from the next batch on (batches under way finish on their model)."""
        logger.info("serving %s (was %s)", loaded.cid, self.current.cid)
        self.current = loaded

    @property
    def queued(self) -> int:
        return self._send.statistics().current_buffer_used

    async def predict(self, x: torch.Tensor) -> tuple[torch.Tensor, str]:
        """The model's outputs for ``x`` and the CID of the model that computed them."""
        pending = _Pending(x)
        if self.queued_samples + len(x) > MAX_QUEUED_SAMPLES:
            self.counts["busy"] += 1
            raise Busy(f"{self.queued_samples} samples are queued; retry")
        try:
            self._send.send_nowait(pending)
        except trio.WouldBlock:
            self.counts["busy"] += 1
            raise Busy(f"{MAX_QUEUED_REQUESTS} requests are queued; retry") from None
        self.queued_samples += len(x)
        await pending.done.wait()
        if pending.outputs is None:
            raise RuntimeError(pending.error)
        return pending.outputs, pending.cid

    async def run(self) -> None:
        """Answer queued requests batch by batch, forever (cancel to stop)."""
        while True:
            batch = await self._take()
            loaded = self.current
            groups: dict[tuple[int, ...], list[_Pending]] = {}
            for pending in batch:  # sequences of different lengths cannot share one tensor
                groups.setdefault(tuple(pending.x.shape[1:]), []).append(pending)
            for group in groups.values():
                await self._answer(loaded, group)

    async def _take(self) -> list[_Pending]:
        first = self._carry or await self._recv.receive()
        self._carry = None
        batch, samples = [first], len(first.x)
        deadline = trio.current_time() + self.max_wait_s
        while samples < self.max_batch:
            try:  # what is queued already joins at once, even with max_wait 0
                pending = self._recv.receive_nowait()
            except trio.WouldBlock:
                pending = None
                with trio.move_on_at(deadline):
                    pending = await self._recv.receive()
                if pending is None:
                    break
            assert pending is not None  # (the None branch broke out above)
            if samples + len(pending.x) > self.max_batch:
                self._carry = pending
                break
            batch.append(pending)
            samples += len(pending.x)
        return batch

    async def _answer(self, loaded: Loaded, group: list[_Pending]) -> None:
        self.queued_samples -= sum(len(p.x) for p in group)
        try:
            out = await trio.to_thread.run_sync(forward, loaded, [p.x for p in group])
        except Exception as exc:  # a model that fails on checked input: answer, count, keep serving
            self.counts["failed"] += len(group)
            logger.exception("forward of %d requests on %s failed", len(group), loaded.cid)
            for p in group:
                p.error = f"the model failed on this batch: {type(exc).__name__}: {exc}"
                p.done.set()
            return
        self.counts["batches"] += 1
        start = 0
        for p in group:
            p.outputs, p.cid = out[start:start + len(p.x)], loaded.cid
            start += len(p.x)
            p.done.set()
        self.counts["requests"] += len(group)
        self.counts["samples"] += start
