"""The binary frames of an all-reduce round (protocol ``/p2ptrain/collective/1.0.0``).

A frame is a 24-byte struct header followed by raw tensor bytes, a round digest (HELLO) or a culprit
and a short UTF-8 reason (ABORT); nothing here is ever unpickled. The collective
(:mod:`p2ptrain.collective._links`) checks every field against what it expects at that point of the
round, so a stale frame from an aborted round, or one for the wrong step, is refused rather than
summed. This module only says what the bytes are: it lives in ``wire/`` with our other formats, below
the collective, and peers running older code read exactly these bytes (tests/wire/test_frames.py).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from enum import IntEnum

import torch
from libp2p.peer.id import ID

# The libp2p protocol of a round's channels, whose frames this module describes.
PROTOCOL = "/p2ptrain/collective/1.0.0"
MAGIC = b"PC"
VERSION = 1
HEADER = struct.Struct(">2sBBQBHIIB")  # magic, version, kind, round, phase, step, seg, count, dtype
# An ABORT's reason is for a log line: 512 bytes are sent and read at most.
MAX_REASON = 512
# An ABORT's culprit is a peer ID: an Ed25519 identity multihash is 38 bytes, 128 leaves room for
# any key type libp2p knows and refuses a longer one before it is parsed.
MAX_CULPRIT_ID = 128


class FrameError(ValueError):
    """A frame that is not a well-formed collective frame (the only error of its decoders)."""


class Kind(IntEnum):
    HELLO = 1  # first frame on a round's channel: the round digest
    READY = 2  # the receiver has joined the same round; data may flow
    DATA = 3
    ABORT = 4  # the round failed: names the peer to blame
    BUSY = 5  # HELLO refused for now (sender not in a plan known here, or its share is full): retry


class Phase(IntEnum):
    NONE = 0
    BROADCAST = 1  # bytes one member sends to every other (a slice's sparse index set)
    REDUCE = 2  # reduce-scatter: partial sums travel one hop per step
    GATHER = 3  # all-gather: each chunk owner's final bytes travel around the ring
    VERIFY = 4  # robust rounds: a member's contribution to a chunk, sent to that chunk's verifier too
    CONFIRM = 5  # robust rounds: what each member received from every other, as signed digests
    CHECKED = 6  # sampled robust rounds: a drawn chunk's verifier found it equal to its recomputation


# A frame's dtype byte: the element type of its tensor bytes (0 in frames that carry none).
DTYPES: dict[torch.dtype, int] = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.uint8: 4}

# The largest first frame on a channel, which is read before anything is known of its sender: HELLO
# with its 32-byte digest, or an ABORT notice (culprit and reason); 1,304 bytes leave room for both.
MAX_FIRST_FRAME = HEADER.size + 256 + 1024


@dataclass(frozen=True)
class Header:
    kind: int
    round_id: int
    phase: int = Phase.NONE
    step: int = 0
    seg: int = 0
    count: int = 0
    dtype: int = 0

    def pack(self) -> bytes:
        return HEADER.pack(
            MAGIC, VERSION, self.kind, self.round_id, self.phase, self.step, self.seg, self.count,
            self.dtype,
        )


def parse_header(frame: bytes) -> Header:
    """The header of ``frame``; :class:`FrameError` if it is short or not ours."""
    if len(frame) < HEADER.size:
        raise FrameError(f"frame of {len(frame)} bytes is shorter than the {HEADER.size}-byte header")
    magic, version, kind, round_id, phase, step, seg, count, dtype = HEADER.unpack_from(frame)
    if magic != MAGIC or version != VERSION:
        raise FrameError(f"not a collective frame (magic {magic!r}, version {version})")
    if kind not in Kind.__members__.values():
        raise FrameError(f"unknown frame kind {kind}")
    return Header(kind, round_id, phase, step, seg, count, dtype)


def hello_frame(round_id: int, digest: bytes) -> bytes:
    """HELLO, the first frame a dialer sends on a round's channel: the round and its digest."""
    return Header(Kind.HELLO, round_id).pack() + digest


def ready_frame(round_id: int) -> bytes:
    """READY: the receiver has joined the same round; data may flow."""
    return Header(Kind.READY, round_id).pack()


def busy_frame(round_id: int) -> bytes:
    """BUSY: the HELLO for ``round_id`` is refused for now; the dialer retries on a fresh channel."""
    return Header(Kind.BUSY, round_id).pack()


def is_busy(frame: bytes, round_id: int) -> bool:
    """Whether ``frame`` is a BUSY answer to our HELLO for ``round_id`` (anything else, well-formed
    or not, is for the caller to judge)."""
    try:
        header = parse_header(frame)
    except FrameError:
        return False
    return header.kind == Kind.BUSY and header.round_id == round_id


def abort_frame(round_id: int, culprit: ID, reason: str) -> bytes:
    """An ABORT frame: the culprit's peer ID bytes, then the reason (UTF-8, truncated)."""
    who = culprit.to_bytes()
    text = reason.encode("utf-8", "replace")[:MAX_REASON]
    return Header(Kind.ABORT, round_id, count=len(who)).pack() + who + text


def parse_abort(frame: bytes, header: Header) -> tuple[ID, str]:
    """The culprit and reason of an ABORT frame; :class:`FrameError` if malformed (an ID is at
    most MAX_CULPRIT_ID bytes, a reason at most MAX_REASON bytes are read)."""
    body = frame[HEADER.size :]
    if header.count == 0 or header.count > MAX_CULPRIT_ID or len(body) < header.count:
        raise FrameError("malformed abort frame")
    culprit = ID(bytes(body[: header.count]))
    reason = bytes(body[header.count : header.count + MAX_REASON]).decode("utf-8", "replace")
    return culprit, reason


# What a member signs in a robust round (collective/_witness.py): a statement that it sent these bytes.
SIGNATURE_BYTES = 64  # Ed25519
DIGEST_BYTES = 32  # SHA-256 of the bytes a statement is about
ENTRY_BYTES = DIGEST_BYTES + SIGNATURE_BYTES  # one statement in a CONFIRM frame or an owner's inputs
_STATEMENT_DOMAIN = b"p2ptrain/collective/statement/v1\0"


class Said(IntEnum):
    """What a statement is about: the bytes a member sent in one part of a robust round."""

    INDICES = 1  # a sparse round's index set of one slice, broadcast by its selector (key: the member)
    CONTRIBUTION = 2  # a member's values of one chunk, sent to the chunk's owner (key: the chunk)
    RESULT = 3  # a chunk's reduced values, sent by its owner to every member (key: the chunk)
    VALUES = 4  # a member's quantized values, broadcast to every member (key: the member)
    SAMPLE = 5  # a verifier's draw for its chunk, over the owner's result digest (key: the chunk)


def statement(round_digest: bytes, said: int, key: int, digest: bytes) -> bytes:
    """The bytes a member signs to say that, in the round of ``round_digest`` (which names the round
    id, the ring and every parameter), the bytes it sent as ``said`` ``key`` hash to ``digest``.
    Ed25519 signatures are deterministic: one key signs one statement one way, so two valid
    signatures over different digests for the same round, kind and key prove equivocation."""
    if len(round_digest) != 32 or len(digest) != DIGEST_BYTES:
        raise FrameError("a statement names a 32-byte round digest and a 32-byte digest")
    return _STATEMENT_DOMAIN + round_digest + bytes([said]) + key.to_bytes(4, "big") + digest


def round_digest(round_id: int, ring: list[ID], description: str) -> bytes:
    """What every member must agree on before any data flows: round, ring order, and the shape.

    ``description`` carries the algorithm, element count, dtypes, density and op; two peers that
    disagree on any of it would otherwise sum garbage.
    """
    h = hashlib.sha256(b"p2ptrain/collective/round/v1\0")
    h.update(round_id.to_bytes(8, "big"))
    for peer in ring:
        raw = peer.to_bytes()
        h.update(len(raw).to_bytes(2, "big") + raw)
    h.update(description.encode())
    return h.digest()


# A sampled robust round (collective/_sampling.py): a verifier's draw, at the end of its CONFIRM
# frame, is the owner's result digest it drew over and its signature of that; an owner's RESULT
# carries the norms of the contributions it reduced, one big-endian float64 per member, before its
# signature.
DRAW_BYTES = DIGEST_BYTES + SIGNATURE_BYTES
NORM = struct.Struct(">d")
NORM_BYTES = NORM.size


def norms_bytes(norms: list[float]) -> bytes:
    """The norms an owner reports with its chunk (what it clipped to the median of)."""
    return b"".join(NORM.pack(n) for n in norms)


def parse_norms(raw: bytes, size: int) -> list[float]:
    """The ``size`` norms of :func:`norms_bytes`; :class:`FrameError` unless ``raw`` is exactly
    that long and every norm a finite float >= 0."""
    if len(raw) != size * NORM.size:
        raise FrameError(f"{len(raw)} bytes of norms for {size} members")
    norms = [value for (value,) in NORM.iter_unpack(raw)]
    if not all(0.0 <= n < float("inf") for n in norms):  # NaN fails both comparisons
        raise FrameError("a norm that is negative or not finite")
    return norms


def parse_draw(raw: bytes) -> tuple[bytes, bytes]:
    """The digest and the signature of a verifier's draw; :class:`FrameError` unless it is exactly
    :data:`DRAW_BYTES` long."""
    if len(raw) != DRAW_BYTES:
        raise FrameError(f"a draw of {len(raw)} bytes, not {DRAW_BYTES}")
    return bytes(raw[:DIGEST_BYTES]), bytes(raw[DIGEST_BYTES:])
