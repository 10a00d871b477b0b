"""Collective: one host's entry point for all-reduce rounds over libp2p streams."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID

from p2ptrain.collective._direct import direct_allreduce
from p2ptrain.collective._failures import BadPayload, CollectiveError, Misbehaved, single_failure
from p2ptrain.collective._gather import gather_description, witnessed_gather
from p2ptrain.collective._owners import Owners, drawn
from p2ptrain.collective._ring import FLOAT_DTYPES, SEGMENT_BYTES, ring_allreduce
from p2ptrain.collective._round_hub import RoundHub
from p2ptrain.collective._round_spec import RoundSpec
from p2ptrain.collective._sparse import Range, check_ranges, clt_k_round, select_ranges, slice_of, slice_ranges
from p2ptrain.collective._witness import Witness
from p2ptrain.base import all_finite
from p2ptrain.wire import DTYPES, PROTOCOL, round_digest

logger = logging.getLogger(__name__)

DENSE = RoundSpec()  # the exact dense mean, 5 s a hop


@dataclass
class RoundStats:
    """What the last round cost this peer: wall time, bytes it put on the wire and bytes it took off
    it (frames + headers)."""

    round_id: int
    seconds: float
    bytes_sent: int
    bytes_received: int = 0


class Collective:
    """All-reduce over an agreed ring of peers, on one libp2p host.

    Create one per host (it registers the stream handler for ``protocol``), then call
    :meth:`allreduce` with the same ``ring`` and ``round_id`` on every member. Round ids must be fresh
    for every attempt: a retry after :class:`PeerFailed` uses a new id (and usually a new ring).
    """

    def __init__(
        self, host: IHost, protocol: str = PROTOCOL, *, segment_bytes: int = SEGMENT_BYTES
    ) -> None:
        self.host = host
        self.hub = RoundHub(host, protocol)
        self._key = host.get_private_key()  # signs what we send in robust rounds (collective.witness)
        self.segment_bytes = segment_bytes
        self.last_round: RoundStats | None = None

    @property
    def peer_id(self) -> ID:
        return self.hub.me

    async def allreduce(
        self, tensor: torch.Tensor, ring: list[ID], round_id: int, spec: RoundSpec = DENSE, *,
        seed: int | None = None, owner_seed: int | None = None,
    ) -> torch.Tensor:
        """The mean (or sum) over the ring of every member's ``tensor``, identical bits everywhere.

        ``tensor`` is flat float32/float16/bfloat16 and is not modified. With ``spec.density < 1``
        this is a one-shot sparse all-reduce: each member picks the top ``density`` share of its own
        entries in its slice of the tensor and the ring sums exactly the union of those entries
        (zeros elsewhere); for training use :class:`SparseAllReducer`, which keeps what was not sent
        (error feedback).

        ``spec.timeout`` bounds every hop; ``spec.start_timeout`` (default ``timeout``) bounds waiting
        for the neighbours to join. A dead, stalled or misbehaving peer raises :class:`PeerFailed`
        naming it. ``spec.robust="clip"`` clips every member's contribution to the round's median
        norm (:mod:`p2ptrain.collective._robust`); every member must pass the same spec. ``seed`` and
        ``owner_seed``: as in :meth:`sparse_round`.
        """
        _check_tensor(tensor)
        if spec.density >= 1.0:
            out = tensor.detach().clone()
            await self.dense_round(out, ring, round_id, spec, owner_seed=owner_seed)
            return out
        k = max(1, math.ceil(spec.density * tensor.numel()))
        flat = tensor.detach()
        idx, values = await self.sparse_round(
            flat, ring, round_id, spec, sizes=[flat.numel()], ks=[k], select=lambda ranges: select_ranges(flat, ranges),
            seed=seed, owner_seed=owner_seed,
        )
        out = torch.zeros_like(flat)
        out.index_copy_(0, idx, values.to(flat.dtype))
        return out

    async def dense_round(
        self, data: torch.Tensor, ring: list[ID], round_id: int, spec: RoundSpec = DENSE, *,
        owner_seed: int | None = None,
    ) -> None:
        """All-reduce ``data`` in place (flat, contiguous): the exact dense ring.

        With ``spec.robust="clip"`` the direct exchange instead (every member meets every other),
        since in a ring nobody sees a member's contribution alone, only partial sums: each chunk's
        owner clips the contributions to it, and its verifier checks it (``owner_seed``: as in
        :meth:`sparse_round`). Same chunks and summation order, so without a hostile member it
        differs from the ring only where a norm exceeds the median.
        """
        _check_tensor(data)
        if not data.is_contiguous():
            raise CollectiveError("the tensor must be contiguous")
        suffix, owners = _checks(spec, len(ring), round_id if owner_seed is None else owner_seed, direct=True)
        description = dense_description(data.numel(), data.dtype, spec.op, spec.robust) + suffix
        digest = round_digest(round_id, ring, description)
        started = time.perf_counter()
        with self._counting_refusals(round_id):
            async with self.hub.open_round(
                ring, round_id, digest, timeout=spec.timeout, start_timeout=spec.join_timeout,
                mesh=spec.robust != "none",
            ) as links:
                _check_finite_local(data)
                if spec.robust == "none":
                    await ring_allreduce(links, data, average=spec.average, segment_bytes=self.segment_bytes)
                else:
                    witness = Witness(links, digest, self._key)
                    await direct_allreduce(links, data, spec, owners=owners, witness=witness,
                                           segment_bytes=self.segment_bytes)  # its CONFIRM too
        self.last_round = RoundStats(round_id, time.perf_counter() - started, links.bytes_sent, links.bytes_received)

    async def sparse_round(
        self, source: torch.Tensor, ring: list[ID], round_id: int, spec: RoundSpec, *, sizes: Sequence[int],
        ks: Sequence[int], select: Callable[[list[Range]], torch.Tensor], prepare: Callable[[], None] | None = None,
        seed: int | None = None, owner_seed: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sliced CLT-k: each member's ``select(ranges)`` picks its slice's indices, the ring
        reduces ``source`` at their union.

        ``source`` is cut in buckets of ``sizes`` with ``ks`` indices each (every member must pass
        the same). ``select`` gets this member's ranges ``(start, end, k)`` and returns, sorted, k
        global indices in each. ``prepare()`` and then ``select`` run in a worker thread, overlapping
        with the round's setup; ``source`` is read only after ``prepare`` returned, so it may fill
        ``source`` (its size and dtype must be final). Returns the sorted indices and the reduced
        values (``spec.values_of(source.dtype)``), the same bits on every member. ``spec.quantize``
        (``"int8"``, ``"2bit"``): the values travel quantized (the value dtype is then unused and the
        values come back float32); with ``spec.robust``, every member clips. A member whose bytes we
        refuse is counted (``refused_bad_payload`` in the hub's stats) and named in the failure.
        ``seed`` (default ``round_id``, the same on every member) rotates which slice each member picks.
        ``owner_seed`` (default ``round_id``; the same on every member, and one no member can choose:
        the runtime passes a hash of the run's last confirmed model and the round's number) draws, in
        a robust round, who reduces and who checks each chunk of the values
        (:mod:`p2ptrain.collective._owners`); it never changes the result's bits. A robust round
        names a member whose bytes another member's check proves wrong (:class:`Misbehaved`,
        counted as ``refused_misbehaved``).
        """
        _check_tensor(source)
        if len(sizes) != len(ks) or sum(sizes) != source.numel():
            raise CollectiveError(f"bucket sizes must add up to the tensor's {source.numel()} entries")
        if not all(0 <= k <= n for n, k in zip(sizes, ks)) or sum(ks) < 1:
            raise CollectiveError("every bucket's k must be in [0, its size], and at least one index sent")
        description = sparse_description(sizes, ks, source.dtype, spec.values_of(source.dtype), spec.op, spec.robust)
        if spec.quantize is not None:  # members must agree on it; plain rounds keep their digests
            description += f" quantize={spec.quantize}"
        seed_of_owners = round_id if owner_seed is None else owner_seed
        suffix, owners = _checks(spec, len(ring), seed_of_owners, direct=spec.quantize is None)
        description += suffix
        digest = round_digest(round_id, ring, description)
        ranges = slice_ranges(sizes, ks, len(ring))
        rotation = round_id if seed is None else seed
        mine_ranges = ranges[slice_of(ring.index(self.peer_id), rotation, len(ring))] if self.peer_id in ring else []
        selected: list[torch.Tensor | Exception] = []
        done = trio.Event()

        def work() -> torch.Tensor:
            if prepare is not None:
                prepare()
            chosen = select(mine_ranges)
            check_ranges(chosen, mine_ranges)
            return chosen

        async def run_local() -> None:
            # In a thread (torch and numpy release the GIL), so the local work overlaps with the
            # round's setup instead of stalling this host's networking.
            try:
                selected.append(await trio.to_thread.run_sync(work))
            except Exception as error:
                selected.append(error)
            done.set()

        started = time.perf_counter()
        with self._counting_refusals(round_id):
            with single_failure():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(run_local)
                    async with self.hub.open_round(
                        ring, round_id, digest, timeout=spec.timeout, start_timeout=spec.join_timeout, mesh=True,
                    ) as links:
                        logger.debug("round %d: connected (%.1f ms)", round_id, _ms(started))
                        await done.wait()
                        logger.debug("round %d: selected (%.1f ms)", round_id, _ms(started))
                        if isinstance(selected[0], Exception):
                            raise selected[0]
                        witness = Witness(links, digest, self._key) if spec.robust != "none" else None
                        result = await clt_k_round(
                            links, source, spec, ranges=ranges, mine=selected[0], segment_bytes=self.segment_bytes,
                            rotation=rotation, owners=owners, witness=witness,
                        )
        self.last_round = RoundStats(round_id, time.perf_counter() - started, links.bytes_sent, links.bytes_received)
        return result

    async def gather(
        self, payload: bytes, ring: list[ID], round_id: int, *, max_bytes: int,
        check: Callable[[int, bytes], object], timeout: float = DENSE.timeout, start_timeout: float | None = None,
        joined: Callable[[], object] | None = None,
    ) -> list[bytes]:
        """Every member's ``payload`` (at most ``max_bytes``), in ring order, the same list on every
        member: each slot its member's own, signed, and compared by every member before it returns
        (:mod:`p2ptrain.collective._gather`). ``check(member, raw)`` raises ``ValueError`` to refuse
        the payload of ring member ``member``: the round fails as :class:`BadPayload` naming it. An
        equivocating member fails it as :class:`Misbehaved`. ``timeout`` bounds every hop,
        ``start_timeout`` (default ``timeout``) waiting for the members to join. ``joined()`` is
        called once every member has joined, before this member sends anything in the round: until
        then a caller may cancel the gather knowing that no member can complete it (a pipelined
        step's summary, protocol/_step_aborts.py)."""
        if len(payload) > max_bytes:
            raise CollectiveError(f"a payload of {len(payload)} bytes in a gather of at most {max_bytes}")
        digest = round_digest(round_id, ring, gather_description(max_bytes))
        started = time.perf_counter()
        with self._counting_refusals(round_id):
            async with self.hub.open_round(
                ring, round_id, digest, timeout=timeout, start_timeout=start_timeout or timeout, mesh=True,
            ) as links:
                if joined is not None:
                    joined()
                witness = Witness(links, digest, self._key)
                out = await witnessed_gather(links, payload, witness, max_bytes=max_bytes, check=check,
                                             segment_bytes=self.segment_bytes)
                await witness.confirm()
        self.last_round = RoundStats(round_id, time.perf_counter() - started, links.bytes_sent, links.bytes_received)
        return out

    def announce(self, round_id: int, within: float) -> None:
        """This member will join round ``round_id`` within ``within`` seconds, later than the others
        may (a pipelined step's summary, which a driver joins once its step is done): the channels
        they open to it first wait here until then, not the parking window alone."""
        self.hub.announce(round_id, within)

    @contextmanager
    def _counting_refusals(self, round_id: int) -> Iterator[None]:
        """Count and log a round that fails on what a peer sent (a robust round's own check, too)."""
        try:
            yield
        except (BadPayload, Misbehaved) as error:
            why = "bad_payload" if isinstance(error, BadPayload) else "misbehaved"
            self.hub.refused[why] += 1
            logger.warning("round %d: refused what %s sent: %s", round_id, error.peer_id, error.reason)
            raise


def _checks(spec: RoundSpec, size: int, seed: int, *, direct: bool) -> tuple[str, Owners | None]:
    """A robust round's checks: the suffix of its description (members that check differently, or
    drew other owners, fail the round at HELLO; a plain round's description stays as it was) and, in
    the direct exchange, the owners and verifiers drawn from ``seed``."""
    if spec.robust == "none":
        return "", None
    if not direct:
        return " witnessed", None
    owners = drawn(size, seed)
    # Members that sample differently fail at HELLO; checking every chunk keeps the digests it had.
    sampling = f" check_fraction={spec.check_fraction!r}" if spec.check_fraction < 1.0 else ""
    return f" witnessed {owners.describe()}{sampling}", owners


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1e3


def dense_description(n: int, dtype: torch.dtype, op: str, robust: str = "none") -> str:
    """What members of a dense round must agree on (hashed into the round digest)."""
    return f"dense n={n} dtype={DTYPES[dtype]} op={op}" + _robust_suffix(robust)


def sparse_description(
    sizes: Sequence[int], ks: Sequence[int], dtype: torch.dtype, value_dtype: torch.dtype, op: str,
    robust: str = "none",
) -> str:
    """What members of a sliced CLT-k round must agree on (hashed into the round digest)."""
    layout = hashlib.sha256(json.dumps([list(sizes), list(ks)]).encode()).hexdigest()[:16]
    return (
        f"clt-k/sliced n={sum(sizes)} k={sum(ks)} buckets={len(sizes)} layout={layout} "
        f"dtype={DTYPES[dtype]} values={DTYPES[value_dtype]} op={op}"
    ) + _robust_suffix(robust)


def _robust_suffix(robust: str) -> str:
    """Members must agree on the rule (a clipping owner and a plain one give different bits); the
    plain mean adds nothing, so its digests are those of before the option existed."""
    return "" if robust == "none" else f" robust={robust}"


def _check_tensor(tensor: torch.Tensor) -> None:
    if tensor.dtype not in FLOAT_DTYPES:
        raise CollectiveError(f"unsupported dtype {tensor.dtype}; use float32, float16 or bfloat16")
    if tensor.dim() != 1:
        raise CollectiveError(f"the tensor must be flat (1-D), got shape {tuple(tensor.shape)}")
    if tensor.device.type != "cpu":
        raise CollectiveError("the tensor must be on the CPU")


def _check_finite_local(tensor: torch.Tensor) -> None:
    """Refuse our own NaN/Inf inside the round, so the other members hear at once that we left."""
    if not all_finite(tensor):
        raise ValueError("local tensor contains NaN or Inf")

