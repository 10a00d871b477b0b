"""Every format we exchange with peers: signed, versioned, schema-checked, size-limited pubsub
messages (:mod:`~p2ptrain.wire.codec`, :mod:`~p2ptrain.wire.messages`) and the collective's binary
frames (:mod:`~p2ptrain.wire.frames`, imported on its own: it needs torch). No pickle.
docs/mesh.md's table lists each, with the module that declares it."""

from p2ptrain.wire.codec import DecodeError, Signed, decode, encode, peek_type
from p2ptrain.wire.replay import ReplayGuard

__all__ = ["DecodeError", "ReplayGuard", "Signed", "decode", "encode", "peek_type"]
