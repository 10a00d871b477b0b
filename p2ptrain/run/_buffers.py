"""The members' buffers combined at a checkpoint, so that the state every member hashes is the same.

A model's buffers (BatchNorm's running means and variances, counters) are not trained by the
gradient: each member's come from its own data, so they differ at a span's end and are combined
before the checkpoint is stored and attested (:meth:`~p2ptrain.training.Trainer.buffer_vector`).

How, by the task's ``[compression] robust``:

- ``"none"`` (members trust each other): the plain mean, by the exact dense all-reduce.
- ``"clip"`` (they do not): each member's vector to every member by a witnessed gather
  (:meth:`~p2ptrain.collective.Collective.gather`: each slot signed by its member, compared by
  every member, so one that sends different values to different members is named), each refused
  unless it has the vector's length and only finite values, then the coordinate-wise median, the
  same bits on every member. A mean moves under one member: a member sending 1e30 moved every
  honest member's running statistics by 1e30 / P, and the honest quorum attested the poisoned
  model (tests/runtime/test_buffer_poison.py). Clipping norms, as the gradients' robust round does,
  would not do either: a member could put the median norm into one running variance and turn it
  negative. With fewer than half the ring hostile, each coordinate of the median lies between the
  honest members' values (docs/security.md).

A member the gather names (bad values, equivocation, gone) fails the combination as the round
failures do: the caller leaves it out of later plans, and this span has no checkpoint.
"""

from __future__ import annotations

import numpy as np
import torch
from libp2p.peer.id import ID

from p2ptrain.collective import Collective, CollectiveError, RoundSpec

# Bytes of one value on the wire: float32, little-endian, as buffer_vector makes them.
_VALUE = np.dtype("<f4")


def coordinate_median(parts: list[torch.Tensor]) -> torch.Tensor:
    """The coordinate-wise median of equal-length float32 vectors (for an even count, the mean of
    the two middle values): each value within the range of any majority of ``parts``, and the same
    bits wherever the same ``parts`` come in, whatever their order."""
    ordered = torch.stack(parts).sort(dim=0).values
    n = len(parts)
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def decode_buffers(raw: bytes, count: int) -> torch.Tensor:
    """A member's buffer vector as it came in a gather; ``ValueError`` unless it is ``count``
    finite float32 values."""
    if len(raw) != count * _VALUE.itemsize:
        raise ValueError(f"buffers of {len(raw)} bytes where {count} float32 values take {count * _VALUE.itemsize}")
    values = np.frombuffer(raw, dtype=_VALUE)
    if not np.isfinite(values).all():
        raise ValueError("buffers with a NaN or infinite value")
    return torch.from_numpy(values.astype(np.float32))


async def combine_buffers(
    collective: Collective, flat: torch.Tensor, ring: list[ID], round_id: int, *, robust: str, timeout: float,
    start_timeout: float,
) -> torch.Tensor:
    """``flat`` (this member's buffers, float32) combined with the ``ring``'s: the mean where
    ``robust`` is ``"none"``, else the coordinate-wise median of a witnessed gather (the module
    docstring says why). Raises the collective's errors, naming the member at fault where one is."""
    if robust == "none":
        return await collective.allreduce(flat, ring, round_id, RoundSpec(timeout=timeout, start_timeout=start_timeout))
    count = flat.numel()
    own = flat.detach().to(dtype=torch.float32).contiguous()
    if not bool(torch.isfinite(own).all()):
        # The others would refuse them: say so here, where the cause is (the training diverged).
        raise CollectiveError("this member's own buffers hold a NaN or infinite value")
    mine = own.numpy().astype(_VALUE).tobytes()
    decoded: dict[int, torch.Tensor] = {}

    def check(member: int, raw: bytes) -> None:
        decoded[member] = decode_buffers(raw, count)

    parts = await collective.gather(mine, ring, round_id, max_bytes=len(mine), check=check, timeout=timeout,
                                    start_timeout=start_timeout)
    # Every slot but our own was checked as it came; ours is ``mine``, checked above.
    return coordinate_median([decoded[i] if i in decoded else decode_buffers(raw, count) for i, raw in enumerate(parts)])
