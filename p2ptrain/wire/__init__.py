"""Our one wire format: versioned, schema-checked, size-limited, signed messages. No pickle."""

from p2ptrain.wire.codec import DecodeError, Signed, decode, encode
from p2ptrain.wire.replay import ReplayGuard

__all__ = ["DecodeError", "ReplayGuard", "Signed", "decode", "encode"]
