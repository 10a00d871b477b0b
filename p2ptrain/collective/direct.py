"""Direct exchange: every member sends each part straight to the member that owns it.

Same volume as the ring — each member sends (P-1)/P of the data to owners and (P-1)/P of the
finished parts back (2(P-1)/P in all, the lower bound) — but in 2 hops instead of 2(P-1), over
P-1 channels per member (hivemind's "butterfly" all-reduce has this shape). For the small payloads
of a sparse round, latency (hops) dominates, not bandwidth, so this is what CLT-k uses; the
pipelined ring stays the choice for big dense tensors.

Determinism is the ring's: chunk c is owned by member c-1 and summed in the order c, c+1, ..., c-1,
exactly the order the ring adds in, so the two algorithms give the same bits, and the owner's bytes
are what everyone copies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import trio

from p2ptrain.collective.errors import BadPayload, single_failure
from p2ptrain.collective.ring import SEGMENT_BYTES, chunk_bounds, segments
from p2ptrain.collective.robust import clip_scales, contribution_norm, scaled
from p2ptrain.collective.links import RoundLinks
from p2ptrain.collective.spec import RoundSpec
from p2ptrain.wire.frames import DTYPES, HEADER, Header, Kind, Phase


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy())  # type: ignore[arg-type]  # an ndarray is a buffer


async def direct_allreduce(
    links: RoundLinks, data: torch.Tensor, spec: RoundSpec, *, segment_bytes: int = SEGMENT_BYTES,
) -> None:
    """Sum (or average, ``spec.op``) the flat contiguous ``data`` of every member in place,
    bitwise-identically.

    ``spec.robust="clip"``: the owner of a chunk clips each member's contribution to it to the
    median of their norms before summing (:mod:`p2ptrain.collective.robust`); only the owner
    computes, and its bytes are what everyone copies.
    """
    size, me, ring = links.size, links.me, links.ring
    if size == 1:
        return
    dtype = data.dtype
    code = DTYPES[dtype]
    bounds = chunk_bounds(data.numel(), size)
    seg_elems = max(1, segment_bytes // data.element_size())
    segs = [segments(bounds[c], bounds[c + 1], seg_elems) for c in range(size)]
    mine = (me + 1) % size  # the chunk this member owns
    contributions: dict[int, list[torch.Tensor]] = {}

    async def send_chunk(chunk: int, phase: int, to: int) -> None:
        for j, (a, b) in enumerate(segs[chunk]):
            header = Header(Kind.DATA, links.round_id, phase, chunk, j, b - a, code)
            await links.send(header, _bytes_of(data[a:b]), to=ring[to])

    async def receive(chunk: int, phase: int, source: int, store: Callable[[int, int, torch.Tensor], None]) -> None:
        for j, (a, b) in enumerate(segs[chunk]):
            incoming = await links.recv_tensor(
                phase=phase, step=chunk, seg=j, count=b - a, dtype=dtype, source=ring[source]
            )
            store(a, b, incoming)

    def keep(member: int) -> Callable[[int, int, torch.Tensor], None]:
        parts = contributions.setdefault(member, [])
        return lambda a, b, incoming: parts.append(incoming)

    with single_failure():
        async with trio.open_nursery() as nursery:
            for chunk in range(size):
                if chunk != mine:
                    nursery.start_soon(send_chunk, chunk, Phase.REDUCE, (chunk - 1) % size)
            for member in range(size):
                if member != me:
                    nursery.start_soon(receive, mine, Phase.REDUCE, member, keep(member))

    def part(member: int, j: int) -> torch.Tensor:
        a, b = segs[mine][j]
        return data[a:b] if member == me else contributions[member][j]

    scales = [1.0] * size
    if spec.robust == "clip":
        scales = clip_scales([contribution_norm([part(m, j) for j in range(len(segs[mine]))]) for m in range(size)])
    for j, (a, b) in enumerate(segs[mine]):
        first = part(mine, j)
        total = first.clone() if scales[mine] == 1.0 else scaled(first, scales[mine])
        for step in range(1, size):
            member = (mine + step) % size
            total = torch.add(scaled(part(member, j), scales[member]), total)
        if spec.average:
            total.div_(size)
        data[a:b].copy_(total)

    def place(a: int, b: int, incoming: torch.Tensor) -> None:
        data[a:b].copy_(incoming)

    with single_failure():
        async with trio.open_nursery() as nursery:
            for member in range(size):
                if member != me:
                    nursery.start_soon(send_chunk, mine, Phase.GATHER, member)
            for chunk in range(size):
                if chunk != mine:
                    nursery.start_soon(receive, chunk, Phase.GATHER, (chunk - 1) % size, place)


async def direct_broadcast(
    links: RoundLinks, leader: int, payload: bytes | None, *, max_bytes: int,
    check: Callable[[bytes], object], segment_bytes: int = SEGMENT_BYTES,
) -> bytes:
    """The leader's ``payload``, sent by the leader to every member (one hop); checked on arrival.

    The first frame announces the payload's size in its count and carries its first segment, so
    a small payload costs one frame.
    """
    size, me, ring = links.size, links.me, links.ring
    u8 = DTYPES[torch.uint8]
    if me == leader:
        assert payload is not None
        if size == 1:
            return payload
        view = memoryview(payload)

        async def send_to(member: int) -> None:
            to = ring[member]
            await links.send(
                Header(Kind.DATA, links.round_id, Phase.BROADCAST, 0, 0, len(view), u8), view[:segment_bytes], to=to
            )
            for j, a in enumerate(range(segment_bytes, len(view), segment_bytes)):
                part = view[a : a + segment_bytes]
                await links.send(Header(Kind.DATA, links.round_id, Phase.BROADCAST, 1, j, len(part), u8), part, to=to)

        with single_failure():
            async with trio.open_nursery() as nursery:
                for member in range(size):
                    if member != me:
                        nursery.start_soon(send_to, member)
        return payload
    source = ring[leader]
    total, frame = await links.recv_announced(
        phase=Phase.BROADCAST, step=0, dtype=u8, max_count=max_bytes, first=segment_bytes, source=source
    )
    out = bytearray(memoryview(frame)[HEADER.size :])
    for j, a in enumerate(range(segment_bytes, total, segment_bytes)):
        n = min(segment_bytes, total - a)
        frame = await links.recv(phase=Phase.BROADCAST, step=1, seg=j, count=n, dtype=u8, nbytes=n, source=source)
        out += memoryview(frame)[len(frame) - n :]
    payload = bytes(out)
    try:
        check(payload)
    except ValueError as error:
        raise BadPayload(source, f"sent an invalid broadcast: {error}") from None
    return payload
