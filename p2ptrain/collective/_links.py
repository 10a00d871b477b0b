"""RoundLinks: one member's channels in one round, every frame checked against the schedule.

Split from :mod:`p2ptrain.collective._round_hub` (which opens rounds and serves channels): what the
algorithms (ring, direct exchange, CLT-k, quantized) use while a round runs: send and receive with
the hop deadline, and the one check that a received frame is exactly the one expected next.
"""

from __future__ import annotations

import warnings

import torch
import trio
from libp2p.peer.id import ID

from p2ptrain.collective._failures import BadPayload, PeerFailed
from p2ptrain.collective._notice_hold import NoticeHold
from p2ptrain.net import Channel, ChannelError, MessageTooLarge
from p2ptrain.base import all_finite
from p2ptrain.wire import DTYPES, HEADER, Header, Kind, Phase, parse_abort, parse_header

# How long a member that lost a neighbour's channel waits for the abort notice that may explain it
# (see wait_for_abort_notice). A deadline, not a sleep: the notice ends the wait when it comes.
# 0.5 s: a notice travels on a stream of its own (a yamux stream open and protocol negotiation on
# an open connection, milliseconds on a LAN, tens of ms on a loaded 2-core box), sent as soon as
# its sender sees the failure; waiting longer only delays the blame when no notice is coming.
_ABORT_NOTICE_WAIT_S = 0.5


async def wait_for_abort_notice() -> None:
    """After a channel of a round broke: give the abort notice that may explain it (naming the
    real culprit) up to ``_ABORT_NOTICE_WAIT_S`` to arrive, before the caller blames the peer.

    Always called inside the round's cancel scope, which the notice cancels on arrival
    (:meth:`RoundHub._on_abort`): the notice itself ends this wait, and ``open_round`` then raises
    it. Returning means no notice came in time.
    """
    await trio.sleep(_ABORT_NOTICE_WAIT_S)


class RoundLinks:
    """One member's channels in a round: to its right neighbour and from its left one (ring), or
    to and from every other member (mesh).

    Every send and receive has the hop deadline; every received frame is checked against exactly the
    frame the schedule expects next. ``to``/``source`` default to the ring neighbours.
    """

    def __init__(
        self, ring: list[ID], me: int, round_id: int, timeout: float, inbound: dict[ID, Channel],
        outbound: dict[ID, Channel], notices: NoticeHold,
    ) -> None:
        self.ring = ring
        self.me = me
        self.size = len(ring)
        self.round_id = round_id
        self.timeout = timeout
        self.left_peer = ring[(me - 1) % self.size]
        self.right_peer = ring[(me + 1) % self.size]
        self._inbound = inbound
        self._outbound = outbound
        self.bytes_sent = 0
        self.bytes_received = 0  # frames taken off the inbound channels, length prefixes included
        # Whose abort notices wait for a verifier's verdict (a sampled round's checks hold them).
        self.notices = notices

    async def _explain_break(self, peer: ID, *, owed_copy: bool = False) -> None:
        """After ``peer``'s channel broke (or it sent an abort notice in-band while held): the
        notices that may explain it. A notice of ``peer``'s own that we hold until its chunk is
        checked may be true (it saw a member fail, then left): wait for the verdict, at most the
        hop deadline; released, the notice ends the round here (its cancellation). Not when
        ``peer`` owed us a VERIFY copy (``owed_copy``): our own check needs it, so we are a verdict
        another member may be waiting for (the verifier of a drawn chunk, waiting for ours before it
        leaves), and the missing copy is our own evidence. Returning means nothing explained it:
        the caller blames ``peer``."""
        await wait_for_abort_notice()
        if self.notices.keeps(peer) and not owed_copy:
            with trio.move_on_after(self.timeout):
                await self.notices.resolved(peer)
            await trio.lowlevel.checkpoint()  # a released notice's cancellation lands here

    async def send(self, header: Header, payload: bytes | memoryview = b"", *, to: ID | None = None) -> None:
        peer = self.right_peer if to is None else to
        frame = header.pack() + payload
        try:
            with trio.fail_after(self.timeout):
                await self._outbound[peer].send(frame)
        except trio.TooSlowError:
            raise PeerFailed(
                peer, f"did not accept round {self.round_id} data within {self.timeout:g} s"
            ) from None
        except ChannelError as error:
            await self._explain_break(peer)
            raise PeerFailed(peer, f"channel broke while sending: {error}", gone=True) from error
        self.bytes_sent += len(frame) + 8  # the channel's length prefix

    async def recv(
        self, *, phase: int, step: int, seg: int, count: int, dtype: int, nbytes: int,
        source: ID | None = None, patience: float = 0.0,
    ) -> bytes:
        """The next frame's payload, which must be exactly the one described.

        ``patience`` extends the deadline: in a ring, a frame k steps in depends on peers k hops
        away, so a member far from a stalled peer waits a little longer and hears the abort notice
        of the member next to it, instead of blaming its own (healthy, starved) neighbour.
        """
        peer, frame, header = await self._next(source, nbytes, patience, owed_copy=phase == Phase.VERIFY)
        expected = Header(Kind.DATA, self.round_id, phase, step, seg, count, dtype)
        if header != expected or len(frame) != HEADER.size + nbytes:
            raise BadPayload(
                peer,
                f"unexpected frame {header} with {len(frame) - HEADER.size} payload bytes; "
                f"expected {expected} with {nbytes}",
            )
        return frame

    async def recv_announced(
        self, *, phase: int, step: int, dtype: int, max_count: int, first: int, source: ID | None = None,
    ) -> tuple[int, bytes]:
        """The first frame of a message whose size the sender announces in the frame's count (at
        most ``max_count``); the frame carries its first ``min(count, first)`` bytes."""
        peer, frame, header = await self._next(source, min(max_count, first), 0.0)
        expected = Header(Kind.DATA, self.round_id, phase, step, 0, header.count, dtype)
        if header != expected or header.count > max_count or len(frame) != HEADER.size + min(header.count, first):
            raise BadPayload(
                peer,
                f"unexpected frame {header} with {len(frame) - HEADER.size} payload bytes; expected "
                f"phase {phase} step {step} announcing at most {max_count} bytes",
            )
        return header.count, frame

    async def _next(
        self, source: ID | None, nbytes: int, patience: float, *, owed_copy: bool = False,
    ) -> tuple[ID, bytes, Header]:
        """The next frame from ``source`` (default: the left neighbour), of at most ``nbytes``
        payload bytes (``owed_copy``: a VERIFY copy, see :meth:`_explain_break`); ABORT notices
        raise here."""
        peer = self.left_peer if source is None else source
        try:
            with trio.fail_after(self.timeout + patience):
                frame = await self._inbound[peer].recv(HEADER.size + nbytes)
        except trio.TooSlowError:
            raise PeerFailed(
                peer, f"sent nothing for round {self.round_id} within {self.timeout:g} s"
            ) from None
        except MessageTooLarge as error:
            raise BadPayload(peer, f"sent an oversized frame: {error}") from None
        except ChannelError as error:
            await self._explain_break(peer, owed_copy=owed_copy)
            raise PeerFailed(peer, f"channel broke while receiving: {error}", gone=True) from error
        self.bytes_received += len(frame) + 8  # the channel's length prefix
        try:
            header = parse_header(frame)
        except ValueError as error:
            raise BadPayload(peer, str(error)) from None
        if header.kind == Kind.ABORT:
            culprit, reason = parse_abort(frame, header)
            notice = PeerFailed(culprit, reason, reported_by=peer)
            if not self.notices.holds(peer):
                raise notice
            self.notices.notice(peer, notice)  # held: it waits for the verdict, as on its own stream
            await self._explain_break(peer, owed_copy=owed_copy)
            raise PeerFailed(peer, "left its round while its chunk was checked", gone=True)
        return peer, frame, header

    async def recv_tensor(
        self, *, phase: int, step: int, seg: int, count: int, dtype: torch.dtype, source: ID | None = None,
        patience: float = 0.0,
    ) -> torch.Tensor:
        """The next frame as a read-only tensor of ``count`` finite values of ``dtype``."""
        values, _ = await self.recv_tensor_trailed(phase=phase, step=step, seg=seg, count=count, dtype=dtype,
                                                   trailer=0, source=source, patience=patience)
        return values

    async def recv_tensor_trailed(
        self, *, phase: int, step: int, seg: int, count: int, dtype: torch.dtype, trailer: int,
        source: ID | None = None, patience: float = 0.0,
    ) -> tuple[torch.Tensor, bytes]:
        """:meth:`recv_tensor` of a frame whose payload ends with exactly ``trailer`` more bytes (a
        robust round's signatures ride on the last frame of what they sign); the values and those."""
        width = torch.empty((), dtype=dtype).element_size()
        frame = await self.recv(
            phase=phase, step=step, seg=seg, count=count, dtype=DTYPES[dtype], nbytes=count * width + trailer,
            source=source, patience=patience,
        )
        peer = self.left_peer if source is None else source
        if count == 0:  # an empty chunk's frame (it carries a trailer)
            return torch.empty(0, dtype=dtype), bytes(memoryview(frame)[HEADER.size :])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we never write into it
            values = torch.frombuffer(frame, dtype=dtype, count=count, offset=HEADER.size)
        if not all_finite(values):
            raise BadPayload(peer, f"sent NaN or Inf values (phase {phase}, step {step})")
        return values, bytes(memoryview(frame)[HEADER.size + count * width :])
