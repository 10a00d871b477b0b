"""The values of a sparse round, quantized (int8 or 2-bit, :mod:`p2ptrain.wire.quantization`) and all-gathered.

Summing quantized values at a chunk owner would need the sum sent back at full precision (or
quantized again, with nobody's error feedback to keep the loss). Instead, as in SparseLoCo, every
member sends its own quantized values to every other (the direct broadcast: one hop), and every
member dequantizes all of them and sums them in member order 0, 1, ..., P-1. The same bytes and the
same float32 operations in the same order give the same bits on every member; a member's own values
go through the same decode, so it adds exactly what the others add for it.

``robust="clip"`` works here at every member rather than at an owner: each member has every
member's dequantized contribution, so each computes their norms
(:func:`~p2ptrain.collective._robust.exact_norm`, the same float on any CPU), the radius and the
factors from the same bytes, and scales each contribution before adding it: the same bits
everywhere again. The clipped vector is a member's whole contribution (in the fp32 path, each
owner's chunk of it). What a clip removes is not put back in anyone's residual, as in the fp32
path: the sender's error feedback keeps only what the quantization dropped (it believes it sent
what it encoded).

Volume per member: (P - 1) x the encoded values (for 2-bit, 0.28 bytes a value with the scales),
against 2 (P - 1) / P x 4 bytes a value for the float32 reduce-scatter and all-gather.
"""

from __future__ import annotations

import torch
import trio

from p2ptrain.collective._direct import witnessed_broadcast
from p2ptrain.collective._failures import single_failure
from p2ptrain.collective._ring import SEGMENT_BYTES
from p2ptrain.collective._robust import clip_scales, exact_norm, scaled
from p2ptrain.collective._links import RoundLinks
from p2ptrain.collective._round_spec import RoundSpec
from p2ptrain.collective._witness import Witness
from p2ptrain.wire import Said
from p2ptrain.wire.quantization import decode, encode, encoded_size


async def quantized_allreduce(
    links: RoundLinks, values: torch.Tensor, spec: RoundSpec, *, witness: Witness | None = None,
    segment_bytes: int = SEGMENT_BYTES,
) -> torch.Tensor:
    """The sum (or mean, ``spec.op``) over the round's members of their ``values`` (flat float32,
    the same count everywhere), each quantized as ``spec.quantize``; the same bits on every member.
    A member whose bytes do not decode to that count of values fails the round as
    :class:`BadPayload` naming it. ``spec.robust="clip"``: each dequantized contribution is clipped
    to the median of their norms first. ``witness`` (a robust round): each member's encoded values
    travel signed, for the round's CONFIRM exchange (an equivocating member is named there)."""
    if spec.quantize is None:
        raise ValueError("a quantized round needs spec.quantize")
    kind = spec.quantize
    count = values.numel()
    size = links.size
    decoded: list[torch.Tensor | None] = [None] * size
    mine = encode(values, kind)
    decoded[links.me] = decode(mine, count, kind)

    async def gather(member: int) -> None:
        def check(raw: bytes) -> None:
            decoded[member] = decode(raw, count, kind)

        await witnessed_broadcast(
            links, member, mine if member == links.me else None, witness=witness, said=Said.VALUES,
            max_bytes=encoded_size(count, kind), check=check, segment_bytes=segment_bytes,
        )

    if size > 1:
        with single_failure():
            async with trio.open_nursery() as nursery:
                for member in range(size):
                    nursery.start_soon(gather, member)
    parts = [part for part in decoded if part is not None]
    assert len(parts) == size  # every broadcast completed, or the round raised
    factors = [1.0] * size
    if spec.robust == "clip":  # ~10 ms per 100,000 values and member: off the event loop
        factors = await trio.to_thread.run_sync(lambda: clip_scales([exact_norm(part) for part in parts]))
    total = torch.zeros(count, dtype=torch.float32)
    for part, factor in zip(parts, factors):
        total.add_(scaled(part, factor))
    if spec.average:
        total.div_(size)
    return total
