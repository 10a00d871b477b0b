"""What each member of a robust round said, signed, and the exchange that compares it.

In the direct exchange one member's bytes reach several others: a slice's index set and a chunk's
reduced values go to every member, a member's contribution to a chunk goes to its owner and its
verifier. A member that sends different bytes to different members (equivocation) passes every
check of the bytes themselves, and the members end the round with different models: before this,
no checkpoint could be confirmed again and nobody was named (issue 27).

So in a robust round every member signs, with its peer key, a statement of each thing it sends
(:func:`~p2ptrain.wire.statement`: the round's digest, what it is, which one, the SHA-256 of
the bytes) and sends the 64-byte signature after the bytes. After the all-gather every member sends
every other one CONFIRM frame: for each broadcast item, the digest of what it received and the
signature that came with it (96 bytes an item). A member whose own digest of an item differs from
the one a peer reports checks the peer's signature: if the item's sender signed it, the sender
signed two different things for the same round and item, and Ed25519 signs one message one way
only, so the sender equivocated (it is named); if not, the peer made the report up (it is named).
Either way the evidence is this member's own. Every honest member receives the same honest reports,
so all of them name the same equivocator; none of them ends the round before every peer's CONFIRM
has arrived and agreed.

On the healthy path every digest agrees: a member signs what it sends (P + 1 signatures a round,
~27 us each), hashes what it receives (SHA-256, ~1.4 GB/s here) and verifies the signature of every
item it receives (~78 us each: the P - 1 index sets and chunks, and as an owner the P - 1
contributions it reduces, which it forwards to its chunk's verifier as the proof of what it was sent,
:mod:`p2ptrain.collective._direct`). A receiver checks at once because what it reports at CONFIRM
must be signed by its sender: otherwise an equivocator could send one member bytes under a bad
signature and have that member blamed for "reporting" them.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Sequence

import torch
import trio
from libp2p.crypto.keys import PrivateKey
from libp2p.peer.id import ID

from p2ptrain.collective._failures import BadPayload, Misbehaved, single_failure
from p2ptrain.collective._links import RoundLinks
from p2ptrain.base import short_id
from p2ptrain.wire import DIGEST_BYTES, DTYPES, ENTRY_BYTES, HEADER, SIGNATURE_BYTES, Header, Kind, Phase, Said, statement

logger = logging.getLogger(__name__)

_U8 = DTYPES[torch.uint8]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous tensor (no copy)."""
    return memoryview(t.view(torch.uint8).numpy())  # type: ignore[arg-type]  # an ndarray is a buffer


def digest_of(parts: Sequence[torch.Tensor | bytes | memoryview]) -> bytes:
    """SHA-256 of consecutive pieces (tensors by their bytes), as if they were one buffer."""
    h = hashlib.sha256()
    for part in parts:
        h.update(tensor_bytes(part) if isinstance(part, torch.Tensor) else part)
    return h.digest()


@functools.lru_cache(maxsize=1024)
def _public_key(peer: ID):  # type: ignore[no-untyped-def]  # libp2p's PublicKey | None
    return peer.extract_public_key()


def signed_by(peer: ID, message: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``peer``'s over ``message`` (its key is in its ID)."""
    key = _public_key(peer)
    if key is None or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        return bool(key.verify(message, signature))
    except Exception:  # a malformed signature is a wrong one
        return False


class Witness:
    """One member's record of a robust round: the statements it signed and the signed digests of
    every broadcast item it received, keyed by (what, which); and the CONFIRM exchange."""

    def __init__(self, links: RoundLinks, round_digest: bytes, key: PrivateKey) -> None:
        self.links = links
        self.round_digest = round_digest
        self._key = key
        # (said, key) -> (ring position of its signer, digest, signature): broadcast items only.
        self.items: dict[tuple[int, int], tuple[int, bytes, bytes]] = {}

    def statement(self, said: int, key: int, digest: bytes) -> bytes:
        return statement(self.round_digest, said, key, digest)

    def sign(self, said: int, key: int, digest: bytes) -> bytes:
        """Our signature of a statement about bytes we send (recorded when every member gets them)."""
        signature = self.signature(said, key, digest)
        if said not in (Said.CONTRIBUTION, Said.SAMPLE):
            self.items[(said, key)] = (self.links.me, digest, signature)
        return signature

    def signature(self, said: int, key: int, digest: bytes) -> bytes:
        """Our signature of a statement, unrecorded (Ed25519's: the same bytes every time)."""
        signature: bytes = self._key.sign(self.statement(said, key, digest))
        return signature

    def heard(self, said: int, key: int, signer: int, digest: bytes, signature: bytes) -> None:
        """Record a broadcast item received from ``signer``, whose signature must be over exactly
        these bytes (:class:`BadPayload` naming it if not): what we report at :meth:`confirm` is
        then signed by its sender, so a peer that finds our report differs from its own copy blames
        the sender, never us."""
        if not self.signed(signer, said, key, digest, signature):
            raise BadPayload(self.links.ring[signer], f"its {Said(said).name.lower()} {key} does not match its signature")
        self.items[(said, key)] = (signer, digest, bytes(signature))

    def signed(self, signer: int, said: int, key: int, digest: bytes, signature: bytes) -> bool:
        """Whether ring member ``signer`` signed that the bytes of (``said``, ``key``) hash to ``digest``."""
        return signed_by(self.links.ring[signer], self.statement(said, key, digest), signature)

    async def confirm(self, extra: bytes = b"", heard: Callable[[int, bytes], None] | None = None) -> dict[int, bytes]:
        """Send every other member what we received (digest and signature of every broadcast item)
        and compare what each of them received with it; :class:`Misbehaved` naming an equivocator,
        or a member that reports a signature its signer never made. Returns once every member's
        report agrees with ours: what each member (by ring position, us too) sent after its report,
        ``extra`` of ours (every member's is as long: a sampled round's draw, collective._direct);
        ``heard(member, its extra)`` is called as each member's report arrives, before it is compared."""
        links = self.links
        if links.size == 1:
            return {links.me: extra}
        keys = sorted(self.items)
        report = b"".join(self.items[k][1] + self.items[k][2] for k in keys)
        size = len(report) + len(extra)
        header = Header(Kind.DATA, links.round_id, Phase.CONFIRM, 0, 0, size, _U8)
        extras = {links.me: extra}

        async def tell(member: int) -> None:
            await links.send(header, report + extra, to=links.ring[member])

        async def check(member: int) -> None:
            peer = links.ring[member]
            frame = await links.recv(phase=Phase.CONFIRM, step=0, seg=0, count=size, dtype=_U8, nbytes=size,
                                     source=peer)
            theirs = memoryview(frame)[HEADER.size :]
            extras[member] = bytes(theirs[len(report) :])
            if heard is not None:
                heard(member, extras[member])
            for i, (said, key) in enumerate(keys):
                signer, digest, _ = self.items[(said, key)]
                entry = theirs[i * ENTRY_BYTES : (i + 1) * ENTRY_BYTES]
                reported, signature = bytes(entry[:DIGEST_BYTES]), bytes(entry[DIGEST_BYTES:])
                if reported == digest:
                    continue
                what = f"{Said(said).name.lower()} {key}"
                if self.signed(signer, said, key, reported, signature):
                    culprit = links.ring[signer]
                    logger.warning("round %d: %s sent %s different bytes than us (%s): equivocation",
                                   links.round_id, short_id(culprit), short_id(peer), what)
                    raise Misbehaved(culprit, f"equivocated: signed two different {what} in round {links.round_id}")
                raise Misbehaved(peer, f"reported a {what} that its sender never signed")

        with single_failure():
            async with trio.open_nursery() as nursery:
                for member in range(links.size):
                    if member != links.me:
                        nursery.start_soon(tell, member)
                        nursery.start_soon(check, member)
        return extras
