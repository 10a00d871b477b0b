"""Sampled verification: which chunks of a robust round their verifier recomputes, and the bound
every member checks on every chunk.

Recomputing every chunk (:mod:`p2ptrain.collective._direct`) costs every member one more chunk of
every other member's values (VERIFY: +50% of the value bytes with four members). With
``RoundSpec.check_fraction = q < 1`` a chunk is recomputed with probability q, and the choice is
made only after its owner committed to its result: the verifier signs, with its peer key, a
statement of the owner's signed result digest for that round and chunk (Ed25519: the honest
verifier's signature of one message is one fixed string), and the chunk is checked when the
SHA-256 of that signature (the *draw*) falls below q (:func:`sampled`). The owner cannot compute
the draw without the verifier's private key, so whatever result it commits to, it is checked with
probability q; trying other results (grinding) gains nothing, each is checked with probability q
again, and the draw is made only once the result is signed. The draws travel at the end of the
verifiers' CONFIRM frames; every member checks that each is its verifier's signature over the
result digest CONFIRM agreed on, and sends its VERIFY copy of each drawn chunk to that chunk's
verifier, which recomputes it and tells every member it matched (CHECKED) before anyone finishes.

An unchecked chunk is still bounded (:func:`bound_problem`): with its result the owner sends the
norms of the contributions it reduced (signed with the values), every member checks that the norm
it reported for its own contribution is its own, and that the result's norm is within what P
contributions clipped to the median of those norms can sum to. An owner that writes arbitrary
values is named by every member at once; one that stays inside the bound is caught by the draw.
docs/collective.md ("Sampled verification") has the bound, and what it does not cover.

Here too: the draws' check (:func:`drawn_chunks`), the record of every chunk's signed result with
its bound (:func:`heard_result`), and the hold on a drawn chunk's owner's abort notices from the
moment its draw is known (:func:`hold_if_drawn`, :mod:`p2ptrain.collective._notice_hold`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from p2ptrain.collective._failures import BadPayload, Misbehaved
from p2ptrain.collective._links import RoundLinks
from p2ptrain.collective._owners import Owners
from p2ptrain.collective._robust import contribution_norm, median_radius
from p2ptrain.collective._round_spec import RoundSpec
from p2ptrain.collective._witness import Witness, digest_of
from p2ptrain.wire import SIGNATURE_BYTES, FrameError, Said, parse_draw, parse_norms

_DRAW_DOMAIN = b"p2ptrain/collective/sample/v1\0"
# A clipped contribution's norm is at most the radius; P of them summed and averaged in float32
# round to at most ~(P + 2) float32 epsilons above it. 1e-4 leaves room for thousands of members
# and is nothing an attacker can use.
BOUND_SLACK = 1e-4
# The owner's norm of a member's contribution and the member's own are float64 sums of the same
# squares, possibly in another order on another CPU: they agree to ~1e-12.
OWN_NORM_SLACK = 1e-6


def sampled(draw: bytes, fraction: float) -> bool:
    """Whether the chunk of ``draw`` (its verifier's signature, :mod:`p2ptrain.wire` ``Said.SAMPLE``)
    is recomputed when a round checks ``fraction`` of its chunks."""
    if fraction >= 1.0:
        return True
    word = int.from_bytes(hashlib.sha256(_DRAW_DOMAIN + draw).digest()[:8], "big")
    return word < int(fraction * 2**64)


def own_norm_problem(reported: float, mine: float) -> str | None:
    """Why the norm an owner reported for our contribution is not ours (None if it is)."""
    if abs(reported - mine) <= OWN_NORM_SLACK * max(mine, reported, 1e-300):
        return None
    return f"reported the norm of our contribution as {reported:.9g}, not {mine:.9g}"


def bound_problem(norms: Sequence[float], result_norm: float, *, average: bool) -> str | None:
    """Why a chunk's result cannot be the clipped reduction of contributions with these ``norms``
    (None if it can): every clipped contribution has a norm of at most the median radius, so their
    mean is within it (their sum within P times it)."""
    bound = median_radius(norms) * (1 if average else len(norms))
    if result_norm <= bound * (1 + BOUND_SLACK):
        return None
    return f"has norm {result_norm:.6g}, above the {bound:.6g} that clipped contributions can sum to"


def drawn_chunks(witness: Witness, owners: Owners, draws: dict[int, bytes], fraction: float) -> set[int]:
    """The chunks whose verifier's draw (``draws``: each member's, by ring position, as sent with its
    CONFIRM) says to recompute them. A draw must be its verifier's signature over the result digest
    of that chunk that every member holds (CONFIRM compared them): :class:`BadPayload` or
    :class:`Misbehaved` naming the verifier if not."""
    chosen = set()
    for member, raw in draws.items():
        peer, chunk = witness.links.ring[member], owners.checked_by(member)
        assert chunk is not None
        try:
            digest, signature = parse_draw(raw)
        except FrameError as error:
            raise BadPayload(peer, f"sent a malformed draw: {error}") from None
        if member != witness.links.me and not witness.signed(member, Said.SAMPLE, chunk, digest, signature):
            raise BadPayload(peer, f"its draw for chunk {chunk} is not its signature")
        if digest != witness.items[(Said.RESULT, chunk)][1]:
            raise Misbehaved(peer, f"drew chunk {chunk} over a result its owner did not send")
        if sampled(signature, fraction):
            chosen.add(chunk)
    return chosen


def hold_if_drawn(links: RoundLinks, owners: Owners, fraction: float, member: int, raw: bytes) -> None:
    """As soon as we learn that the chunk ring member ``member`` verifies is drawn (its draw
    ``raw``, at its CONFIRM, or ours as we send it), its owner's abort notices wait for ``member``'s
    verdict on it (:mod:`p2ptrain.collective._notice_hold`): the owner learns the draw at CONFIRM too."""
    try:
        _, signature = parse_draw(raw)
    except FrameError:
        return  # drawn_chunks names its sender
    chunk = owners.checked_by(member)
    assert chunk is not None  # a sampled round has verifiers
    if sampled(signature, fraction):
        links.notices.hold(links.ring[owners.owner[chunk]], links.ring[member])


def heard_result(
    witness: Witness, owner: int, chunk: int, parts: list[torch.Tensor], said: bytes, ours: list[torch.Tensor] | None,
    spec: RoundSpec,
) -> bytes:
    """Record chunk ``chunk`` from its ``owner``: ``said`` is what followed its values (the norms
    it reported, in a sampled round, then its signature of both; :class:`BadPayload` naming it if
    the signature is not over these bytes). In a sampled round (``ours``: our own contribution to
    the chunk) also its bound (:func:`bound_problem`): :class:`Misbehaved` naming the
    owner, whose signature is on what breaks it. Returns the digest it signed."""
    reported, signature = said[:-SIGNATURE_BYTES], said[-SIGNATURE_BYTES:]
    digest = digest_of([*parts, reported])
    witness.heard(Said.RESULT, chunk, owner, digest, signature)
    if ours is not None:
        try:
            norms = parse_norms(reported, witness.links.size)
        except FrameError as error:
            raise Misbehaved(witness.links.ring[owner], f"signed chunk {chunk} with bad norms: {error}") from None
        problem = own_norm_problem(norms[witness.links.me], contribution_norm(ours)) or bound_problem(
            norms, contribution_norm(parts), average=spec.average)
        if problem is not None:
            raise Misbehaved(witness.links.ring[owner], f"its chunk {chunk} {problem}")
    return digest
