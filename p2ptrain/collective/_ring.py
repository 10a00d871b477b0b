"""The ring all-reduce over a round's links: exact, pipelined, bitwise-identical everywhere.

The all-reduce is reduce-scatter then all-gather over P nearly equal chunks, each cut into segments
so that a segment travels on as soon as it has been summed (pipelining). Every chunk is summed in
one fixed order, starting at the peer with the chunk's number and going around the ring; the peer
that adds the last term (the chunk's *owner*) finishes it (divides by P for a mean) and everyone else
copies the owner's exact bytes in the all-gather. So every member ends with bitwise-identical
results, which later lets honest peers hash the same model.
"""

from __future__ import annotations

import math

import torch
import trio

from p2ptrain.collective._failures import single_failure
from p2ptrain.collective._links import RoundLinks
from p2ptrain.wire import DTYPES, Header, Kind, Phase

SEGMENT_BYTES = 1 << 20
# Extra deadline per step of the ring schedule (see RoundLinks.recv): the member next to a stalled
# peer times out first and its abort notice reaches the others well within this margin.
STEP_PATIENCE_S = 0.5
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def chunk_bounds(n: int, parts: int) -> list[int]:
    """``parts + 1`` boundaries splitting ``n`` elements into parts whose sizes differ by at most 1."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for c in range(parts):
        bounds.append(bounds[-1] + base + (1 if c < extra else 0))
    return bounds


def segments(start: int, end: int, seg_elems: int) -> list[tuple[int, int]]:
    return [(a, min(a + seg_elems, end)) for a in range(start, end, seg_elems)]


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy())  # type: ignore[arg-type]  # an ndarray is a buffer


async def ring_allreduce(
    links: RoundLinks, data: torch.Tensor, *, average: bool, segment_bytes: int = SEGMENT_BYTES
) -> None:
    """Sum (or average) the flat contiguous ``data`` of every member in place, bitwise-identically."""
    size, me = links.size, links.me
    if size == 1:
        return
    dtype = data.dtype
    code = DTYPES[dtype]
    bounds = chunk_bounds(data.numel(), size)
    seg_elems = max(1, segment_bytes // data.element_size())
    segs = [segments(bounds[c], bounds[c + 1], seg_elems) for c in range(size)]
    outbox_send, outbox = trio.open_memory_channel[tuple[int, int, int, int, int]](math.inf)

    async def sender() -> None:
        async with outbox:
            async for phase, step, seg, a, b in outbox:
                header = Header(Kind.DATA, links.round_id, phase, step, seg, b - a, code)
                await links.send(header, _bytes_of(data[a:b]))

    with single_failure():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
            async with outbox_send:
                for j, (a, b) in enumerate(segs[me]):
                    outbox_send.send_nowait((Phase.REDUCE, 0, j, a, b))
                for step in range(size - 1):
                    chunk = (me - step - 1) % size
                    last = step == size - 2
                    for j, (a, b) in enumerate(segs[chunk]):
                        incoming = await links.recv_tensor(
                            phase=Phase.REDUCE, step=step, seg=j, count=b - a, dtype=dtype,
                            patience=step * STEP_PATIENCE_S,
                        )
                        mine = data[a:b]
                        torch.add(incoming, mine, out=mine)
                        if not last:
                            outbox_send.send_nowait((Phase.REDUCE, step + 1, j, a, b))
                            continue
                        if average:
                            mine.div_(size)
                        outbox_send.send_nowait((Phase.GATHER, 0, j, a, b))
                for step in range(size - 1):
                    chunk = (me - step) % size
                    for j, (a, b) in enumerate(segs[chunk]):
                        incoming = await links.recv_tensor(
                            phase=Phase.GATHER, step=step, seg=j, count=b - a, dtype=dtype,
                            patience=(size - 1 + step) * STEP_PATIENCE_S,
                        )
                        data[a:b].copy_(incoming)
                        if step < size - 2:
                            outbox_send.send_nowait((Phase.GATHER, step + 1, j, a, b))
