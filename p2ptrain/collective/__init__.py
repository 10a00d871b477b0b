"""Ring all-reduce over libp2p streams: exact dense, and top-k sparse with error feedback.

The trainer's surface: :class:`Collective` (one per host) for plain all-reduce rounds, and
:class:`SparseAllReducer` (one per model) for top-k gradient averaging with error feedback; both
take a round's options as one :class:`RoundSpec`.
"""

from p2ptrain.collective.endpoint import Collective, RoundStats
from p2ptrain.collective.errors import BadPayload, CollectiveError, PeerFailed
from p2ptrain.collective.feedback import ErrorFeedback
from p2ptrain.collective.reducer import SparseAllReducer
from p2ptrain.collective.spec import RoundSpec
from p2ptrain.wire.frames import PROTOCOL

__all__ = [
    "PROTOCOL",
    "BadPayload",
    "Collective",
    "CollectiveError",
    "ErrorFeedback",
    "PeerFailed",
    "RoundSpec",
    "RoundStats",
    "SparseAllReducer",
]
