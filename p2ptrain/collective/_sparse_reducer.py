"""SparseAllReducer: top-k gradient averaging with error feedback, one object per model per peer."""

from __future__ import annotations

import logging
import time
import torch
from libp2p.peer.id import ID

from p2ptrain.collective._collective import Collective
from p2ptrain.collective._feedback import ErrorFeedback
from p2ptrain.collective._round_spec import RoundSpec
from p2ptrain.collective._sparse import Workspace, bucket_ks, select_ranges
from p2ptrain.base import large_empty, zero_fill
from p2ptrain.wire.quantization import roundtrip

logger = logging.getLogger(__name__)


class SparseAllReducer:
    """Averages a peer's flat gradient with the ring, sending its top ``spec.density`` share.

    Each call is one all-reduce round (sliced CLT-k: each member picks the indices of its slice). What was not
    sent stays in this object's residual and is added next step. If a round fails
    (:class:`PeerFailed`), the state is unchanged: call again with the same gradient, a new round id
    and the surviving ring. ``density=1.0`` is the exact dense all-reduce. ``robust="clip"`` clips
    every member's contribution to the round's median norm at whoever reduces it
    (:mod:`p2ptrain.collective._robust`); what was clipped off is not kept in anyone's residual (the
    sender believes it was sent, as with a lost round of plain gradient clipping).
    ``quantize="int8"|"2bit"``: the values travel quantized (:mod:`p2ptrain.collective._quantized_gather`),
    and the residual keeps what the quantization dropped (with ``robust="clip"``, every member clips
    the dequantized contributions itself). Every round runs with ``spec`` (its timeouts too); the
    values travel as ``spec.value_dtype`` (None: float32, the gradient's).
    """

    def __init__(
        self, collective: Collective, spec: RoundSpec, *, momentum: float = 0.0, clip_norm: float | None = None,
    ) -> None:
        self.spec = spec
        self.collective = collective
        self.value_dtype = spec.values_of(torch.float32)
        self.momentum = momentum
        self.clip_norm = clip_norm
        self.feedback: ErrorFeedback | None = None
        self.last_indices: torch.Tensor | None = None  # sent in the last round (None: all)
        self._workspace = Workspace()

    async def allreduce(
        self, grad: torch.Tensor, ring: list[ID], round_id: int, *, out: torch.Tensor | None = None,
        seed: int | None = None, owner_seed: int | None = None,
    ) -> torch.Tensor:
        """The ring's average of the members' (compressed) flat float32 gradients.

        Top-k is taken over the whole vector, one bucket (what training has always run: the node
        passes the model's flat gradient). Written into ``out`` when given (saves allocating a
        full-size tensor every step; it is overwritten even if the round fails), else into a new
        tensor. ``seed`` (default ``round_id``; the same on every member) draws the round's top-k
        choices: which slice each member picks, where the threshold sample starts. ``owner_seed``
        (default ``round_id``): who reduces and checks each chunk in a robust round
        (:meth:`Collective.sparse_round`).
        """
        seed = round_id if seed is None else seed
        if grad.dim() != 1:
            raise ValueError("grad must be flat (1-D)")
        sizes = [grad.numel()]
        if self.feedback is None:
            self.feedback = ErrorFeedback(grad.numel(), momentum=self.momentum, clip_norm=self.clip_norm)
        elif grad.numel() != self.feedback.residual.numel():
            raise ValueError("a SparseAllReducer serves one model: the gradient's size changed between steps")
        started = time.perf_counter()
        feedback = self.feedback
        pending = feedback.prepare(grad)
        ks = bucket_ks(sizes, self.spec.density)
        k = sum(ks)
        if k == grad.numel():
            values = feedback.materialize(pending).to(self.value_dtype, copy=True)
            await self.collective.dense_round(values, ring, round_id, self.spec, owner_seed=owner_seed)
            feedback.commit(pending, None, self.value_dtype)
            self.last_indices = None
            if out is None:
                return values.to(torch.float32)
            return out.copy_(values)
        generator = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
        # Every member forms residual + grad during the round's setup (it selects its slice's
        # indices from it; its values at the agreed indices are what it sends; afterwards it simply
        # becomes the residual).
        accumulated = feedback.target(pending)
        result = large_empty(grad.numel()) if out is None else out

        def prepare() -> None:
            feedback.materialize(pending)
            zero_fill(result)  # here rather than after the round, where every member waits for it

        indices, values = await self.collective.sparse_round(
            accumulated, ring, round_id, self.spec, sizes=sizes, ks=ks,
            select=lambda ranges: select_ranges(accumulated, ranges, generator=generator, workspace=self._workspace),
            prepare=prepare, seed=seed, owner_seed=owner_seed,
        )
        # What the others received for our values: the quantization's rounding stays in the residual.
        quantize = self.spec.quantize
        sent = None if quantize is None else roundtrip(accumulated.index_select(0, indices), quantize)
        feedback.commit(pending, indices, self.value_dtype, sent)
        self.last_indices = indices
        logger.debug("round %d: committed (%.1f ms)", round_id, (time.perf_counter() - started) * 1e3)
        result.index_copy_(0, indices, values.to(torch.float32))
        return result
