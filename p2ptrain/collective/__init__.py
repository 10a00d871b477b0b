"""Ring all-reduce over libp2p streams: exact dense, and top-k sparse with error feedback.

The trainer's surface: :class:`Collective` (one per host) for plain all-reduce rounds, and
:class:`SparseAllReducer` (one per model) for top-k gradient averaging with error feedback; both
take a round's options as one :class:`RoundSpec`. Imports ``base``, ``wire`` and ``net``.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.collective._direct import reduce_chunk as reduce_chunk
    from p2ptrain.collective._collective import Collective as Collective, RoundStats as RoundStats
    from p2ptrain.collective._failures import (
        BadPayload as BadPayload,
        CollectiveError as CollectiveError,
        Misbehaved as Misbehaved,
        PeerFailed as PeerFailed,
    )
    from p2ptrain.collective._feedback import ErrorFeedback as ErrorFeedback
    from p2ptrain.collective._sparse_reducer import SparseAllReducer as SparseAllReducer
    from p2ptrain.collective._robust import clip_scales as clip_scales, contribution_norm as contribution_norm, scaled as scaled
    from p2ptrain.collective._round_spec import RoundSpec as RoundSpec
    from p2ptrain.collective._sparse import bucket_ks as bucket_ks
    from p2ptrain.collective._witness import digest_of as digest_of, signed_by as signed_by
    from p2ptrain.wire import PROTOCOL as PROTOCOL
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
