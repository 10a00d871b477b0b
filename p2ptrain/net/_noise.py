"""Noise transport whose secured connection batches socket I/O.

py-libp2p's Noise session turns every write into one socket send per Noise message (at most 65,519
plaintext bytes each) and every read into two small socket reads per message (length, then body),
then copies plaintext through a BytesIO. At bulk rates that Python work, not the cipher, is the
cost.

:class:`NoiseSession` keeps the handshake and the cipher states of py-libp2p's Noise XX
implementation and changes only how bytes meet the socket:

* ``write`` encrypts the whole buffer as consecutive Noise messages and hands them to the socket in
  one send;
* reads take up to :data:`SOCKET_READ` bytes from the socket at a time, decrypt every complete Noise
  message in them, and keep the plaintext pieces without copying them again.

The wire format is unchanged (2-byte big-endian length, ChaCha20-Poly1305 ciphertext of at most
65,535 bytes, nonces in order), so a stock py-libp2p or go-libp2p peer sees ordinary Noise.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from cryptography.exceptions import InvalidTag
from libp2p.abc import IRawConnection, ISecureConn
from libp2p.io.exceptions import ConnectionClosedError, IOException
from libp2p.peer.id import ID
from libp2p.security.noise.io import MAX_NOISE_MESSAGE_LEN, MAX_PLAINTEXT_LENGTH
from libp2p.security.noise.transport import Transport as StockNoiseTransport
from libp2p.security.secure_session import SecureSession
import trio

# One socket read pulls up to this many ciphertext bytes (16 Noise messages).
SOCKET_READ = 1 << 20
_LEN = 2
# Buffers per sendmsg call, well under the kernel's IOV_MAX (1024 on Linux).
_IOV_BATCH = 512


def _trio_socket(raw: IRawConnection) -> trio.socket.SocketType | None:
    """The trio socket under py-libp2p's TCP connection, or None for any other transport.

    After the handshake this session is the only reader and writer of the connection, so it may
    use the socket directly: ``recv_into`` a reused buffer and ``sendmsg`` over the Noise messages
    without joining them.
    """
    stream = getattr(getattr(raw, "stream", None), "stream", None)
    return stream.socket if isinstance(stream, trio.SocketStream) else None


# ChaCha20-Poly1305's tag: a Noise transport message is never shorter.
_TAG = 16


class NoiseFrameError(IOException):
    """A Noise transport message whose length cannot be a ciphertext (shorter than its tag)."""


def message_spans(buf: bytes | bytearray | memoryview, end: int) -> tuple[list[tuple[int, int]], int]:
    """The complete Noise messages in ``buf[:end]``: their ``(start, size)`` ciphertext spans and the
    offset where the incomplete rest begins. A length prefix is 2 bytes, so no message can exceed
    65,535 bytes, which the read buffer always holds. :class:`NoiseFrameError` is its only error."""
    spans: list[tuple[int, int]] = []
    off = 0
    end = min(end, len(buf))
    while end - off >= _LEN:
        size = (buf[off] << 8) | buf[off + 1]
        if size < _TAG:
            raise NoiseFrameError(f"Noise message of {size} bytes is shorter than its {_TAG}-byte tag")
        if end - off - _LEN < size:
            break
        spans.append((off + _LEN, size))
        off += _LEN + size
    return spans, off


class NoiseDecryptError(IOException):
    """A Noise message failed authentication: the connection cannot continue."""


class NoiseSession(SecureSession):
    """A Noise-secured connection with one socket send per write and a buffered reader."""

    def __init__(self, session: SecureSession) -> None:
        super().__init__(
            local_peer=session.local_peer,
            local_private_key=session.local_private_key,
            remote_peer=session.remote_peer,
            remote_permanent_pubkey=session.remote_permanent_pubkey,
            is_initiator=session.is_initiator,
            conn=session.conn,
        )
        noise_state = session.conn.noise_state  # type: ignore[attr-defined]
        protocol = noise_state.noise_protocol
        self._encrypt = protocol.cipher_state_encrypt.encrypt_with_ad
        self._decrypt = protocol.cipher_state_decrypt.decrypt_with_ad
        rw = session.conn.read_writer  # type: ignore[attr-defined]
        self._raw: IRawConnection = rw.read_write_closer
        self._socket = _trio_socket(self._raw)
        # Ciphertext from the socket; an incomplete Noise message stays at the front for the next
        # read.
        self._rbuf = bytearray(SOCKET_READ + _LEN + MAX_NOISE_MESSAGE_LEN)
        self._rfill = 0
        self._plain: deque[memoryview] = deque()
        self._plain_len = 0

    def _broken(self, error: BaseException) -> ConnectionClosedError:
        return ConnectionClosedError(f"Noise connection to {self.remote_peer} broke: {error}")

    # -- writing -------------------------------------------------------------------------------

    def seal_frame(
        self,
        parts: list[bytes | memoryview],
        head: bytes | memoryview,
        body: Iterable[bytes | memoryview] = (),
    ) -> None:
        """Append to ``parts`` the Noise messages carrying ``head`` then each ``body`` buffer.

        Messages are filled to the 65,519-byte maximum across buffer boundaries, so a small header
        shares a message with the start of its payload; a message that lies inside one buffer is
        encrypted straight from it without a copy. The nonce advances here: the caller sends
        ``parts`` before sealing anything else (hold one lock across both).
        """
        pending: list[bytes | memoryview] = []
        room = MAX_PLAINTEXT_LENGTH
        for buf in (head, *body):
            view = memoryview(buf)
            off, end = 0, len(view)
            while off < end:
                take = min(room, end - off)
                pending.append(view[off : off + take])
                off += take
                room -= take
                if not room:
                    self._seal_one(parts, pending)
                    pending = []
                    room = MAX_PLAINTEXT_LENGTH
        if pending:
            self._seal_one(parts, pending)

    def _seal_one(self, parts: list[bytes | memoryview], pending: list[bytes | memoryview]) -> None:
        plaintext = pending[0] if len(pending) == 1 else b"".join(pending)
        ciphertext = self._encrypt(None, plaintext)
        parts.append(len(ciphertext).to_bytes(_LEN, "big"))
        parts.append(ciphertext)

    async def write(self, data: bytes) -> None:
        if not data:
            return
        parts: list[bytes | memoryview] = []
        self.seal_frame(parts, data)
        try:
            await self.send_sealed(parts)
        except trio.Cancelled:
            if parts:
                # These nonces are spent and nobody will send the rest: the connection cannot
                # carry another byte, so end it rather than let the peer fail to decrypt.
                with trio.CancelScope(shield=True):
                    await self._raw.close()
            raise

    async def send_sealed(self, parts: list[bytes | memoryview]) -> None:
        """Send Noise messages built by :meth:`seal_frame` with gathering socket sends.

        ``parts`` is consumed as the kernel takes bytes: if this is cancelled, ``parts`` holds
        exactly the unsent rest, which must be sent before anything else is sealed.
        """
        if self._socket is None:
            try:
                await self._raw.write(b"".join(parts))
            except trio.Cancelled:
                with trio.CancelScope(shield=True):
                    await self._raw.close()  # how much went out is unknown: end the connection
                raise
            parts.clear()
            return
        try:
            while parts:
                batch = parts[:_IOV_BATCH]
                # A cancelled sendmsg has sent nothing (trio checks before each attempt).
                sent = await self._socket.sendmsg(batch)
                taken = 0
                while taken < len(batch) and sent >= len(batch[taken]):
                    sent -= len(batch[taken])
                    taken += 1
                del parts[:taken]
                if sent:
                    parts[0] = memoryview(parts[0])[sent:]
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            raise self._broken(error) from error

    # -- reading -------------------------------------------------------------------------------

    async def _pull(self) -> None:
        """Read once from the socket and decrypt every complete Noise message it completes."""
        buf = self._rbuf
        view = memoryview(buf)
        fill = self._rfill
        if self._socket is not None:
            try:
                got = await self._socket.recv_into(view[fill:])
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
                raise self._broken(error) from error
        else:
            data = await self._raw.read(len(buf) - fill)
            got = len(data)
            view[fill : fill + got] = data
        if not got:
            raise ConnectionClosedError("Connection closed")
        end = fill + got
        spans, off = message_spans(buf, end)
        for start, size in spans:
            try:
                plain = self._decrypt(None, view[start : start + size])
            except InvalidTag as error:
                raise NoiseDecryptError(
                    f"Noise message from {self.remote_peer} failed authentication"
                ) from error
            if plain:
                self._plain.append(memoryview(plain))
                self._plain_len += len(plain)
        tail = end - off
        if tail and off:
            buf[:tail] = bytes(view[off:end])
        self._rfill = tail

    async def read_pieces(self) -> list[memoryview]:
        """All buffered plaintext (reading the socket first if none is buffered), as pieces."""
        while not self._plain:
            await self._pull()
        pieces = list(self._plain)
        self._plain.clear()
        self._plain_len = 0
        return pieces

    async def read(self, n: int | None = None) -> bytes:
        """Stream semantics of py-libp2p's session: ``n`` bytes (fewer only at close), or any."""
        if n == 0:
            return b""
        if n is None:
            return b"".join(await self.read_pieces())
        while self._plain_len < n:
            try:
                await self._pull()
            except ConnectionClosedError:
                if self._plain_len:
                    break
                raise
        out = []
        need = min(n, self._plain_len)
        while need:
            piece = self._plain[0]
            if len(piece) <= need:
                out.append(piece)
                self._plain.popleft()
                need -= len(piece)
                self._plain_len -= len(piece)
            else:
                out.append(piece[:need])
                self._plain[0] = piece[need:]
                self._plain_len -= need
                need = 0
        return b"".join(out)


class NoiseTransport(StockNoiseTransport):
    """py-libp2p's Noise XX handshake, returning a :class:`NoiseSession`."""

    async def secure_inbound(self, conn: IRawConnection) -> ISecureConn:
        session = await super().secure_inbound(conn)
        return NoiseSession(session)  # type: ignore[arg-type]

    async def secure_outbound(self, conn: IRawConnection, peer_id: ID) -> ISecureConn:
        session = await super().secure_outbound(conn, peer_id)
        return NoiseSession(session)  # type: ignore[arg-type]
