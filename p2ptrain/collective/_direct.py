"""Direct exchange: every member sends each part straight to the member that owns it.

Same volume as the ring — each member sends (P-1)/P of the data to owners and (P-1)/P of the
finished parts back (2(P-1)/P in all, the lower bound) — but in 2 hops instead of 2(P-1), over
P-1 channels per member (hivemind's "butterfly" all-reduce has this shape). For the small payloads
of a sparse round, latency (hops) dominates, not bandwidth, so this is what CLT-k uses; the
pipelined ring stays the choice for big dense tensors.

Determinism is the ring's: chunk c is summed in the order c, c+1, ..., c-1 (ring positions), exactly
the order the ring adds in, whoever owns it, so the two algorithms give the same bits, and the
owner's bytes are what everyone copies.

A robust round trusts no owner (docs/collective.md, "Byzantine members"): the owners are drawn per
round (:mod:`p2ptrain.collective._owners`), every member also sends its contribution to a chunk to
that chunk's verifier, which recomputes the chunk and compares it with the owner's bytes, and every
member signs what it sends (:mod:`p2ptrain.collective._witness`). The owner checks the signatures of
the contributions it reduces and forwards them to the verifier: when the verifier's result differs,
it can tell an owner that computed something else (named) from a contributor that sent the two of
them different values (named, by its own signature).

On one channel (one sender, one receiver) the frames go in this order: the receiver's chunk of the
sender's values (REDUCE), the chunk the receiver checks (VERIFY), and the sender's finished chunk
(GATHER). In a robust round the signatures ride after the values of a chunk's last frame (a
trailer: no frames of their own), the contributions' signed digests too, on the GATHER to the
chunk's verifier, and an empty chunk is one empty frame; then CONFIRM.

With sampled verification (``spec.check_fraction < 1``, :mod:`p2ptrain.collective._sampling`) no
VERIFY travels before GATHER: a verifier draws once its chunk's owner has signed the result, sends
the draw at the end of its CONFIRM, and only the drawn chunks are checked after it: on a channel,
the VERIFY of the receiver's chunk if drawn, then the sender's CHECKED (its drawn chunk matched)
if drawn. A round that draws nothing ends at CONFIRM, one hop sooner and with no VERIFY bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import trio

from p2ptrain.collective._failures import BadPayload, Misbehaved, PeerFailed, single_failure
from p2ptrain.collective._links import RoundLinks
from p2ptrain.collective._owners import Owners, ring_owners
from p2ptrain.collective._ring import SEGMENT_BYTES, chunk_bounds, segments
from p2ptrain.collective._robust import clip_scales, contribution_norm, scaled
from p2ptrain.collective._round_spec import RoundSpec
from p2ptrain.collective._sampling import drawn_chunks, heard_result, hold_if_drawn
from p2ptrain.collective._witness import Witness, digest_of, tensor_bytes
from p2ptrain.base import short_id
from p2ptrain.wire import (
    DIGEST_BYTES, DTYPES, ENTRY_BYTES, HEADER, NORM_BYTES, SIGNATURE_BYTES, Header, Kind,
    Phase, Said, norms_bytes,
)

Parts = list[torch.Tensor]  # one member's contribution to a chunk, segment by segment
_T = TypeVar("_T")
_U8 = DTYPES[torch.uint8]


def reduce_chunk(parts: list[Parts], start: int, spec: RoundSpec, norms: list[float] | None = None) -> Parts:
    """Chunk ``start``'s reduction from every member's ``parts`` (by ring position): clipped to the
    median norm under ``spec.robust="clip"`` (``norms``: the contributions' norms, if computed
    already), summed in the order start, start+1, ..., start-1, divided for a mean. The owner and
    the chunk's verifier both run exactly this."""
    size = len(parts)
    scales = [1.0] * size
    if spec.robust == "clip":
        scales = clip_scales(norms if norms is not None else [contribution_norm(p) for p in parts])
    out = []
    for j, first in enumerate(parts[start]):
        total = first.clone() if scales[start] == 1.0 else scaled(first, scales[start])
        for step in range(1, size):
            member = (start + step) % size
            total = torch.add(scaled(parts[member][j], scales[member]), total)
        if spec.average:
            total.div_(size)
        out.append(total)
    return out


async def direct_allreduce(
    links: RoundLinks, data: torch.Tensor, spec: RoundSpec, *, owners: Owners | None = None,
    witness: Witness | None = None, segment_bytes: int = SEGMENT_BYTES,
) -> None:
    """Sum (or average, ``spec.op``) the flat contiguous ``data`` of every member in place,
    bitwise-identically.

    ``owners`` (default: the ring's) says who reduces each chunk and who checks it; ``witness`` (a
    robust round) signs what this member sends, and the round ends with its CONFIRM exchange.
    ``spec.robust="clip"``: the owner of a chunk clips each member's contribution to it to the
    median of their norms before summing (:mod:`p2ptrain.collective._robust`); its bytes are what
    everyone copies, once its verifier (if any) found them equal to its own recomputation. A
    verifier that does not raises :class:`Misbehaved` naming the owner, or the contributor that
    sent the two of them different values. ``spec.check_fraction < 1``: a chunk is recomputed only
    when its verifier's draw, sent with its CONFIRM, says so, and every member checks every chunk's
    bound (:mod:`p2ptrain.collective._sampling`).
    """
    size, me, ring = links.size, links.me, links.ring
    if size == 1:
        return
    owners = owners or ring_owners(size)
    dtype = data.dtype
    code = DTYPES[dtype]
    bounds = chunk_bounds(data.numel(), size)
    seg_elems = max(1, segment_bytes // data.element_size())
    segs = [segments(bounds[c], bounds[c + 1], seg_elems) for c in range(size)]
    if witness is not None:  # every chunk is one frame at least: its signature rides on the last one
        segs = [s or [(bounds[c], bounds[c])] for c, s in enumerate(segs)]
    mine, checking = owners.owned_by(me), owners.checked_by(me)
    # Sampled verification: no VERIFY copies during the exchange; those of drawn chunks after CONFIRM.
    sampling = witness is not None and checking is not None and spec.check_fraction < 1.0
    norms_size = size * NORM_BYTES if sampling else 0

    def local(chunk: int) -> Parts:
        return [data[a:b] for a, b in segs[chunk]]

    held: dict[int, Parts] = {me: local(mine)}  # every member's contribution to our chunk
    checks: dict[int, Parts] = {}  # every member's contribution to the chunk we check
    if checking is not None:
        checks[me] = local(checking)
    inputs: dict[int, bytes] = {}  # signed digests of the contributions to our chunk (for its verifier)
    results: dict[int, Parts] = {}  # every chunk's reduced values, placed into ``data`` at the end
    proofs = bytearray()  # the signed contributions the owner of the chunk we check reduced
    contributed, reduced = trio.Event(), trio.Event()
    signatures: dict[int, bytes] = {}  # what follows our chunk's values: its norms (sampling) and signature
    draw = b""  # sampling: the result digest of the chunk we check and our signature of it (the draw)

    async def send_parts(chunk: int, parts: Parts, phase: int, to: int, trailer: bytes = b"") -> None:
        """``parts`` as frames, ``trailer`` (signatures) after the last one's values."""
        for j, part in enumerate(parts):
            header = Header(Kind.DATA, links.round_id, phase, chunk, j, part.numel(), code)
            payload = tensor_bytes(part)
            await links.send(header, b"".join((payload, trailer)) if trailer and j == len(parts) - 1 else payload,
                             to=ring[to])

    async def feed(member: int) -> None:
        """What we send ``member``, in the channel's order (module docstring)."""
        chunk = owners.owned_by(member)
        signature = b""
        if witness is not None:
            signature = await _off_loop(local(chunk), _signed, witness, Said.CONTRIBUTION, chunk, local(chunk))
        await send_parts(chunk, local(chunk), Phase.REDUCE, member, signature)
        theirs = owners.checked_by(member)
        if theirs is not None and not sampling:
            await send_parts(theirs, local(theirs), Phase.VERIFY, member)
        await reduced.wait()
        trailer = b""
        if witness is not None:
            trailer = signatures[mine]
            if owners.verifier is not None and owners.verifier[mine] == member:
                trailer += b"".join(inputs[m] for m in range(size) if m != me)  # the proof of what it reduced
        await send_parts(mine, results[mine], Phase.GATHER, member, trailer)

    async def receive_parts(chunk: int, phase: int, source: int, trailer: int = 0) -> tuple[Parts, bytes]:
        """A chunk's frames from ``source``, and the ``trailer`` bytes after the last one's values."""
        parts, tail, last = [], b"", len(segs[chunk]) - 1
        for j, (a, b) in enumerate(segs[chunk]):
            part, tail = await links.recv_tensor_trailed(phase=phase, step=chunk, seg=j, count=b - a, dtype=dtype,
                                                         trailer=trailer if j == last else 0, source=ring[source])
            parts.append(part)
        return parts, tail

    async def take(member: int) -> None:
        """What ``member`` sends us, in the channel's order."""
        nonlocal draw
        parts, signature = await receive_parts(mine, Phase.REDUCE, member, SIGNATURE_BYTES if witness else 0)
        if witness is not None:
            digest = await _off_loop(parts, _checked, witness, member, Said.CONTRIBUTION, mine, parts, signature)
            if digest is None:
                raise BadPayload(ring[member], f"its contribution to chunk {mine} does not match its signature")
            inputs[member] = digest + signature
        held[member] = parts
        if len(held) == size:
            contributed.set()
        if checking is not None and not sampling:
            checks[member], _ = await receive_parts(checking, Phase.VERIFY, member)
        chunk = owners.owned_by(member)
        trailer = 0
        if witness is not None:
            trailer = norms_size + SIGNATURE_BYTES + ((size - 1) * ENTRY_BYTES if chunk == checking else 0)
        results[chunk], tail = await receive_parts(chunk, Phase.GATHER, member, trailer)
        if witness is not None:
            said = tail[: norms_size + SIGNATURE_BYTES]
            proofs.extend(tail[len(said) :])
            digest = await _off_loop(results[chunk], heard_result, witness, member, chunk, results[chunk], said,
                                     local(chunk) if sampling else None, spec)
            if sampling and chunk == checking:  # its owner has signed its result: now we draw
                draw = digest + witness.sign(Said.SAMPLE, checking, digest)

    async def spot_check(drawn: set[int]) -> None:
        """After CONFIRM, the drawn chunks: every member sends each one's verifier its contribution
        (VERIFY), the verifier recomputes it and tells every member it matched (CHECKED). On one
        channel: the VERIFY of the receiver's chunk, then the CHECKED of the sender's.

        A CHECKED releases the abort notices of the chunk's owner held here (hold_if_drawn); as the
        verifier we release ours once every member has our CHECKED (a notice acted on here first
        would leave the others waiting for it). When our check fails we still finish our part (our
        VERIFY copies, the other CHECKEDs) before leaving: the members that hold our notice until
        our own drawn chunk is checked must not find our copy missing."""
        copies, verdict = trio.Event(), trio.Event()
        failed: list[Misbehaved] = []
        told = 0

        async def out(member: int) -> None:
            nonlocal told
            theirs = owners.checked_by(member)
            if theirs in drawn:
                await send_parts(theirs, local(theirs), Phase.VERIFY, member)
            if checking in drawn:
                await verdict.wait()
                if failed:
                    return
                await links.send(Header(Kind.DATA, links.round_id, Phase.CHECKED, checking, 0, 0, _U8), to=ring[member])
                told += 1
                if told == size - 1:
                    links.notices.release(ring[owners.owner[checking]])

        async def in_(member: int) -> None:
            if checking in drawn:
                checks[member], _ = await receive_parts(checking, Phase.VERIFY, member)
                if len(checks) == size:
                    copies.set()
            theirs = owners.checked_by(member)
            if theirs in drawn:
                await links.recv(phase=Phase.CHECKED, step=theirs, seg=0, count=0, dtype=_U8, nbytes=0,
                                 source=ring[member])
                links.notices.release(ring[owners.owner[theirs]])

        try:
            with single_failure():
                async with trio.open_nursery() as nursery:
                    for member in range(size):
                        if member != me:
                            nursery.start_soon(out, member)
                            nursery.start_soon(in_, member)
                    if checking in drawn:
                        await copies.wait()
                        try:
                            _check_chunk(links, owners, checking, [checks[m] for m in range(size)], results[checking],
                                         bytes(proofs), spec, witness)
                        except Misbehaved as error:
                            failed.append(error)
                        verdict.set()
        except PeerFailed:
            if not failed:
                raise
        if failed:  # our own evidence comes before what went wrong after it
            raise failed[0]

    with single_failure():
        async with trio.open_nursery() as nursery:
            for member in range(size):
                if member != me:
                    nursery.start_soon(feed, member)
                    nursery.start_soon(take, member)
            await contributed.wait()
            # The reduction and its signature in one go (a hand-off on this path holds up every
            # member waiting for our chunk; a small chunk's reduction is cheaper than a hand-off).
            results[mine], signatures[mine] = await _off_loop(
                held[me], _reduced_and_signed, [held[m] for m in range(size)], mine, spec, witness, sampling
            )
            reduced.set()
    if checking is not None and not sampling:
        _check_chunk(links, owners, checking, [checks[m] for m in range(size)], results[checking], bytes(proofs),
                     spec, witness)
    if witness is not None:
        heard = None
        if sampling:  # the owner can learn our draw once our CONFIRM goes: hold its notices from then on
            heard = functools.partial(hold_if_drawn, links, owners, spec.check_fraction)
            heard(me, draw)
        draws = await witness.confirm(draw, heard=heard)
        if sampling:
            drawn = drawn_chunks(witness, owners, draws, spec.check_fraction)
            if drawn:  # a round that draws nothing ends at CONFIRM: no frames after it, so no tasks for them
                await spot_check(drawn)
    for chunk, parts in results.items():
        for (a, b), part in zip(segs[chunk], parts):
            data[a:b].copy_(part)


# Hashing, signing and verifying a large chunk run in worker threads (hashlib, libsodium and torch
# release the GIL): they overlap the round's traffic instead of holding up every channel of this
# member. A small one runs right here: hashing 64 KiB (~70 us) and one Ed25519 signature or check
# (27-66 us) cost less than a hand-off to a thread and back, which waits for the OS to run both and
# for the GIL (a sparse robust round made 3(P - 1) + 1 of them a member, three on the round's
# critical path: docs/benchmarks.md, "The checks of a robust round", fourth pass).
INLINE_BYTES = 64 * 1024


async def _off_loop(parts: Parts, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)``, in a worker thread where ``parts`` (what it hashes) hold more than
    :data:`INLINE_BYTES`, else here."""
    if sum(p.numel() * p.element_size() for p in parts) > INLINE_BYTES:
        return await trio.to_thread.run_sync(fn, *args)
    return fn(*args)


def _reduced_and_signed(
    parts: list[Parts], start: int, spec: RoundSpec, witness: Witness | None, with_norms: bool,
) -> tuple[Parts, bytes]:
    """The owner's chunk (:func:`reduce_chunk`) and, in a robust round, what follows its values:
    the norms of the contributions (``with_norms``, a sampled round) and its signature of both."""
    norms = [contribution_norm(p) for p in parts] if with_norms else None
    result = reduce_chunk(parts, start, spec, norms=norms)
    if witness is None:
        return result, b""
    reported = b"" if norms is None else norms_bytes(norms)
    return result, reported + witness.sign(Said.RESULT, start, digest_of([*result, reported]))


def _signed(witness: Witness, said: int, key: int, parts: Parts) -> bytes:
    return witness.sign(said, key, digest_of(parts))


def _checked(witness: Witness, signer: int, said: int, key: int, parts: Parts, signature: bytes) -> bytes | None:
    """The digest of ``parts`` if ``signer`` signed it, else None."""
    digest = digest_of(parts)
    return digest if witness.signed(signer, said, key, digest, signature) else None


def _check_chunk(
    links: RoundLinks, owners: Owners, chunk: int, contributions: list[Parts], result: Parts, proofs: bytes,
    spec: RoundSpec, witness: Witness | None,
) -> None:
    """As ``chunk``'s verifier: recompute it from the contributions we received and compare with
    the owner's bytes; on a difference, :class:`Misbehaved` naming whoever the signed digests the
    owner forwarded (``proofs``: one per member but the owner, ring order) prove wrong."""
    ours = reduce_chunk(contributions, chunk, spec)
    if all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ours, result)):
        return
    owner = owners.owner[chunk]
    culprit, why = owner, f"its chunk {chunk} is not the reduction of the contributions (its verifier recomputed it)"
    if witness is not None:
        others = [m for m in range(links.size) if m != owner]
        for i, member in enumerate(others):
            entry = proofs[i * ENTRY_BYTES : (i + 1) * ENTRY_BYTES]
            claimed, signature = entry[:DIGEST_BYTES], entry[DIGEST_BYTES:]
            if claimed == digest_of(contributions[member]):
                continue
            if witness.signed(member, Said.CONTRIBUTION, chunk, claimed, signature):
                culprit, why = member, f"sent chunk {chunk}'s owner and its verifier different values"
            else:
                why = f"forwarded a contribution to chunk {chunk} that {short_id(links.ring[member])} never signed"
            break
    raise Misbehaved(links.ring[culprit], why)


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


async def witnessed_broadcast(
    links: RoundLinks, leader: int, payload: bytes | None, *, witness: Witness | None, said: int, max_bytes: int,
    check: Callable[[bytes], object], segment_bytes: int = SEGMENT_BYTES,
) -> bytes:
    """:func:`direct_broadcast`, in a robust round (``witness``) with the leader's signature of the
    payload after it, which every receiver records for the CONFIRM exchange (the payload's key in
    the statement is the leader's ring position). Returns the payload without the signature."""
    if witness is None:
        return await direct_broadcast(links, leader, payload, max_bytes=max_bytes, check=check,
                                      segment_bytes=segment_bytes)
    if leader == links.me:
        assert payload is not None
        signature = witness.sign(said, leader, digest_of([payload]))
        await direct_broadcast(links, leader, payload + signature, max_bytes=max_bytes + SIGNATURE_BYTES,
                               check=check, segment_bytes=segment_bytes)
        return payload

    def signed(raw: bytes) -> None:
        if len(raw) < SIGNATURE_BYTES:
            raise ValueError("no signature after the payload")
        body = raw[:-SIGNATURE_BYTES]
        check(body)
        witness.heard(said, leader, leader, digest_of([body]), raw[-SIGNATURE_BYTES:])

    raw = await direct_broadcast(links, leader, None, max_bytes=max_bytes + SIGNATURE_BYTES, check=signed,
                                 segment_bytes=segment_bytes)
    return raw[:-SIGNATURE_BYTES]
