"""Top-k sparsification and the CLT-k sparse all-reduce.

Selection: ``torch.topk`` over 16M entries costs 0.35-0.6 s on a small CPU; instead we estimate the
k-th largest magnitude from a ~1% strided sample, keep the entries above a slightly lower threshold
(one compare and one ``flatnonzero``), and cut the few extra candidates exactly at their own k-th
largest magnitude. The result is exactly the top k (ties broken by position), so every member knows
the volume in advance.

All-reduce (CLT-k, after ScaleCom, NeurIPS 2020): members' top-k index sets differ, and a ring that
merges them fills in towards dense. CLT-k instead agrees on one index set, chosen by a leader from
its own accumulated gradient, and every member contributes its own values at exactly those indices
to an exact all-reduce of k values (the direct exchange: same volume and bits as the ring, 2 hops
instead of 2(P-1)). What a member did not send stays in its error-feedback residual, so its large
entries go in a later round.

Here the leadership is sliced: every bucket is cut into P near-equal slices (and its k with it), and
slice m is chosen by member (m + round id) mod P from its own accumulated gradient. So every member
selects from 1/P of the vector at once instead of all members waiting for one leader to select from
all of it (at 64 MiB that wait was ~30 ms of the round's critical path), and each member sends its
slice's indices (as compact gaps, ~1.3 bytes each at 1%) to every other. Volume per member:
2k(P-1)/P values, the lower bound, plus (P-1)/P x k index encodings, evenly spread. Which member
picks which slice rotates with the round id.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import trio

from p2ptrain.collective._direct import direct_allreduce, witnessed_broadcast
from p2ptrain.collective._failures import single_failure
from p2ptrain.collective._quantized_gather import quantized_allreduce
from p2ptrain.collective._ring import SEGMENT_BYTES, chunk_bounds
from p2ptrain.collective._links import RoundLinks
from p2ptrain.collective._owners import Owners
from p2ptrain.collective._round_spec import RoundSpec
from p2ptrain.collective._witness import Witness
from p2ptrain.base import all_finite
from p2ptrain.wire import Said

logger = logging.getLogger(__name__)

_CAP = {1: 0xFF, 2: 0xFFFF}  # index codec: word width -> the capped value that means "escaped"
_WORD: dict[int, np.dtype[Any]] = {1: np.dtype("<u1"), 2: np.dtype("<u2")}
_EXACT_BELOW = 1 << 16  # small tensors: a plain topk is cheaper than sampling
# Entries per block of the candidate scan (Workspace.candidates): 1 MiB of float32 magnitudes, what
# one core's L2 cache holds here; 64K-1M all measured within ~10% of each other, 4M (no blocks) 25% slower.
_BLOCK = 1 << 18


def bucket_ks(sizes: Sequence[int], density: float) -> list[int]:
    """k per bucket: ceil(density * size), at least 1 and at most the bucket's size."""
    return [min(n, max(1, math.ceil(density * n))) if n else 0 for n in sizes]


class Workspace:
    """Scratch buffers for selection, kept between steps (fresh 64 MiB buffers cost page faults).

    Selection works on numpy arrays: on one thread numpy's abs, compare, partition and flatnonzero
    are 1.1-30x faster than torch's (torch.ge into a bool tensor 10.8 ms vs 3.6 ms, kthvalue vs
    partition 0.7 ms vs 0.2 ms on 16M / 210K floats).
    """

    def __init__(self) -> None:
        self._magnitude = np.empty(0, dtype=np.float32)
        self._block = np.empty(_BLOCK, dtype=np.float32)
        self._block_mask = np.empty(_BLOCK, dtype=bool)

    def magnitude(self, x: torch.Tensor) -> np.ndarray:
        """|x| as float32 (exact for float16 and bfloat16 too, so the order is the same)."""
        n = x.numel()
        if self._magnitude.size < n:
            self._magnitude = np.empty(n, dtype=np.float32)
        out = self._magnitude[:n]
        x = x.detach()
        if x.dtype == torch.float32:
            np.abs(x.contiguous().numpy(), out=out)
        else:
            torch.from_numpy(out).copy_(x.abs())
        return out

    def candidates(self, x: torch.Tensor, threshold: np.floating) -> tuple[np.ndarray, np.ndarray]:
        """The sorted positions of the flat ``x`` whose magnitude is at least ``threshold``, and
        those magnitudes (float32).

        Block by block (:data:`_BLOCK` entries), so |x| and the comparison stay in the core's cache
        instead of being written to and read back from memory (two passes of 16 MiB plus a mask of
        4 MiB on a 4M-entry slice): 5.2 -> 3.9 ms for that slice's whole selection on one thread.
        """
        positions, magnitudes = [], []
        for a in range(0, x.numel(), _BLOCK):
            part = _float32(x[a : a + _BLOCK])
            size = part.size
            magnitude = np.abs(part, out=self._block[:size])
            hits = np.flatnonzero(np.greater_equal(magnitude, threshold, out=self._block_mask[:size]))
            positions.append(hits + a)
            magnitudes.append(magnitude[hits])
        return np.concatenate(positions), np.concatenate(magnitudes)


def _float32(x: torch.Tensor) -> np.ndarray:
    """``x`` as a float32 numpy array: a view when it is float32 already (exact for float16 and
    bfloat16, whose every value float32 holds)."""
    x = x.detach()
    return x.numpy() if x.dtype == torch.float32 else x.to(torch.float32).numpy()


def topk_indices(
    x: torch.Tensor, k: int, *, generator: torch.Generator | None = None, sample_share: float = 0.01,
    margin: float = 1.25, workspace: Workspace | None = None,
) -> torch.Tensor:
    """Sorted int64 indices of the ``k`` largest magnitudes of the flat ``x``.

    Exact for small tensors; for large ones the candidates come from a sampled threshold set
    ``margin`` times looser than k, and the final cut is exact among the candidates, so the set is
    the exact top k either way (equal magnitudes at the cut: the lowest positions win).
    """
    n = x.numel()
    if k >= n:
        return torch.arange(n, dtype=torch.int64)
    if k <= 0:
        return torch.empty(0, dtype=torch.int64)
    workspace = workspace or Workspace()
    if n < _EXACT_BELOW:
        return _exact_topk(workspace.magnitude(x), k)
    stride = max(1, int(1 / sample_share))
    start = int(torch.randint(stride, (1,), generator=generator))
    sample = np.abs(_float32(x[start::stride]))
    above = math.ceil(margin * k * sample.size / n)
    rank = sample.size - above
    if rank < 1:
        return _exact_topk(workspace.magnitude(x), k)
    sample.partition(rank - 1)
    candidates, chosen = workspace.candidates(x, sample[rank - 1])  # sorted, and their magnitudes
    if candidates.size < k:  # the sample overestimated the threshold: rare, exact fallback
        return _exact_topk(workspace.magnitude(x), k)
    if candidates.size == k:
        return torch.from_numpy(candidates)
    # Exact cut among the candidates: the k-th largest magnitude, ties broken by position.
    cut = chosen.size - k
    kth = np.partition(chosen, cut)[cut]
    keep = chosen > kth
    missing = k - int(np.count_nonzero(keep))
    if missing:
        keep[np.flatnonzero(chosen == kth)[:missing]] = True
    return torch.from_numpy(candidates[keep])


def _exact_topk(magnitude: np.ndarray, k: int) -> torch.Tensor:
    return torch.topk(torch.from_numpy(magnitude), k, sorted=False).indices.sort().values


Range = tuple[int, int, int]  # (start, end, k): choose k indices in [start, end)


def slice_ranges(sizes: Sequence[int], ks: Sequence[int], parts: int) -> list[list[Range]]:
    """Slice m's ranges, one per bucket: each bucket (consecutive, ``sizes``) and its k cut in
    ``parts`` near-equal pieces. Piece m of k never exceeds piece m of the bucket (both put their
    extra elements first), so every range can give its k."""
    out: list[list[Range]] = [[] for _ in range(parts)]
    offset = 0
    for size, k in zip(sizes, ks, strict=True):
        if not 0 <= k <= size:
            raise ValueError(f"k={k} for a bucket of {size}")
        nb, kb = chunk_bounds(size, parts), chunk_bounds(k, parts)
        for m in range(parts):
            out[m].append((offset + nb[m], offset + nb[m + 1], kb[m + 1] - kb[m]))
        offset += size
    return out


def slice_of(member: int, round_id: int, size: int) -> int:
    """The slice ``member`` (its place in the ring) selects in round ``round_id``."""
    return (member - round_id) % size


def select_ranges(
    x: torch.Tensor, ranges: Sequence[Range], *, generator: torch.Generator | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Top-k of ``x`` in each range, as sorted global indices."""
    workspace = workspace or Workspace()
    parts = [
        topk_indices(x[a:b], k, generator=generator, workspace=workspace) + a for a, b, k in ranges if k
    ]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def check_ranges(indices: torch.Tensor, ranges: Sequence[Range]) -> None:
    """ValueError unless the sorted ``indices`` hold exactly k in each range, in order."""
    if indices.numel() != sum(k for _, _, k in ranges):
        raise ValueError(f"expected {sum(k for _, _, k in ranges)} indices, got {indices.numel()}")
    position = 0
    for a, b, k in ranges:
        if k and not (a <= int(indices[position]) and int(indices[position + k - 1]) < b):
            raise ValueError(f"indices outside the slice [{a}, {b})")
        position += k


def assemble(per_slice: Sequence[torch.Tensor], ranges: Sequence[Sequence[Range]]) -> torch.Tensor:
    """The round's sorted index set from each slice's indices (bucket by bucket, slice by slice)."""
    positions = [0] * len(per_slice)
    pieces = []
    for bucket in range(len(ranges[0])):
        for m, indices in enumerate(per_slice):
            k = ranges[m][bucket][2]
            pieces.append(indices[positions[m] : positions[m] + k])
            positions[m] += k
    return torch.cat(pieces)


def encode_indices(indices: torch.Tensor) -> bytes:
    """Strictly increasing indices as gaps: one width byte w (1 or 2), then every gap as a w-byte
    little-endian word, capped at 2^(8w) - 1, then the full gap (uint32) of every capped one.

    The width is whichever gives fewer bytes: at 1% density a gap averages 100, so most fit one
    byte (~1.3 bytes per index); at 0.1% two bytes are smaller. Two sections, not a varint, so
    decoding is a few vector operations.
    """
    idx = indices.to(torch.int64).numpy()
    gaps = np.diff(idx, prepend=-1) - 1
    if idx.size and gaps.min() < 0:
        raise ValueError("indices must be strictly increasing and non-negative")
    if idx.size and idx[-1] >= 1 << 32:
        raise ValueError("indices must be below 2**32")
    sizes = {w: w * idx.size + 4 * int(np.count_nonzero(gaps >= _CAP[w])) for w in (1, 2)}
    width = min(sizes, key=lambda w: (sizes[w], w))
    words = np.minimum(gaps, _CAP[width]).astype(_WORD[width])
    escaped = gaps[gaps >= _CAP[width]].astype("<u4")
    encoded: bytes = bytes([width]) + words.tobytes() + escaped.tobytes()
    return encoded


def decode_indices(data: bytes, n: int, k: int) -> torch.Tensor:
    """The inverse of :func:`encode_indices`; ValueError unless it holds exactly k indices below n."""
    if not data or data[0] not in _CAP:
        raise ValueError("unknown index encoding")
    width = data[0]
    end = 1 + width * k
    if len(data) < end:
        raise ValueError(f"expected {k} indices, got {len(data)} bytes")
    gaps = np.frombuffer(data, dtype=_WORD[width], count=k, offset=1).astype(np.int64)
    capped = gaps == _CAP[width]
    if len(data) != end + 4 * int(np.count_nonzero(capped)):
        raise ValueError(f"expected {k} indices: {len(data)} bytes do not match their escapes")
    full = np.frombuffer(data, dtype="<u4", offset=end).astype(np.int64)
    if full.size and full.min() < _CAP[width]:
        raise ValueError("an escaped gap is small enough for the word itself")
    gaps[capped] = full
    idx = np.cumsum(gaps + 1) - 1
    if k and idx[-1] >= n:
        raise ValueError(f"index {int(idx[-1])} out of range for {n} entries")
    return torch.from_numpy(idx)


def max_encoded_bytes(n: int, k: int) -> int:
    """The longest :func:`encode_indices` of k indices below n: it picks the shorter width, so at
    most two-byte words plus an escape for each gap of 65,535 or more."""
    return 1 + 2 * k + 4 * (min(k, n // _CAP[2] + 1))


async def clt_k_round(
    links: RoundLinks, source: torch.Tensor, spec: RoundSpec, *, ranges: Sequence[Sequence[Range]],
    mine: torch.Tensor, segment_bytes: int = SEGMENT_BYTES, rotation: int | None = None,
    owners: Owners | None = None, witness: Witness | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sliced CLT-k round: every member sends its slice's indices (``mine``, chosen in
    ``ranges[slice_of(me, rotation)]``; ``rotation`` defaults to the round id) to every other, then
    the exact all-reduce of every member's values at the union, in ``spec.values_of(source.dtype)``
    (``spec.robust="clip"``: each owner clips the contributions to its chunk of those values, see
    :mod:`p2ptrain.collective._robust`). Returns the sorted indices and the reduced values, the same
    bits everywhere. ``spec.quantize`` (``"int8"``, ``"2bit"``): the values travel quantized and
    all-gathered instead (:mod:`p2ptrain.collective._quantized_gather`, where every member clips under
    ``robust="clip"``); the result is float32. ``owners``: who reduces and checks each chunk of the
    values (:mod:`p2ptrain.collective._owners`); ``witness`` (a robust round): index sets, values and
    chunks travel signed, and the round ends with the CONFIRM exchange that names an equivocator
    (:mod:`p2ptrain.collective._witness`)."""
    n, size = source.numel(), links.size
    # Each slice's indices: ours now, the others' as they arrive and pass their check.
    per_slice: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)] * size
    rotation = links.round_id if rotation is None else rotation
    per_slice[slice_of(links.me, rotation, size)] = mine

    async def indices_of(member: int) -> None:
        m = slice_of(member, rotation, size)
        k = sum(count for _, _, count in ranges[m])

        def check(raw: bytes) -> None:
            per_slice[m] = decode_indices(raw, n, k)
            check_ranges(per_slice[m], ranges[m])

        payload = encode_indices(mine) if member == links.me else None
        await witnessed_broadcast(
            links, member, payload, witness=witness, said=Said.INDICES, max_bytes=max_encoded_bytes(n, k),
            check=check, segment_bytes=segment_bytes,
        )

    with single_failure():
        async with trio.open_nursery() as nursery:
            for member in range(size):
                nursery.start_soon(indices_of, member)
    indices = assemble(per_slice, ranges)
    logger.debug("round %d: %d indices agreed", links.round_id, indices.numel())
    if spec.quantize is not None:
        chosen = source.index_select(0, indices).to(torch.float32)
        if not all_finite(chosen):
            raise ValueError("local values contain NaN or Inf")
        values = await quantized_allreduce(links, chosen, spec, witness=witness, segment_bytes=segment_bytes)
        if witness is not None:
            await witness.confirm()
        logger.debug("round %d: %d quantized values reduced", links.round_id, indices.numel())
    else:
        values = source.index_select(0, indices).to(spec.values_of(source.dtype))
        if not all_finite(values):
            raise ValueError("local values contain NaN or Inf (or overflow the value dtype)")
        await direct_allreduce(links, values, spec, owners=owners, witness=witness, segment_bytes=segment_bytes)
        logger.debug("round %d: %d values reduced", links.round_id, indices.numel())
    return indices, values
