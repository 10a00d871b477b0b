"""Fuzz target of the stage protocol's frames (wire/activations.py): activations and gradients as
fp32, fp16 or int8, targets as i64, under a receiver's limits; anything malformed is an ActivationError."""

from __future__ import annotations

import torch
from _p2ptrain_fuzzing import FuzzTarget

from p2ptrain.wire.activations import ActivationError, decode_frame, encode_frame, Frame, Kind, Limits

_LIMITS = Limits(max_rank=4, max_elements=1 << 16)
_G = torch.Generator().manual_seed(0)
_A = torch.randn(2, 3, 40, generator=_G)
_SEEDS = [
    encode_frame(Frame(Kind.LOSS, 3, 7, 3, 0.5, (_A, torch.randint(0, 9, (2, 3), generator=_G))), "fp32"),
    encode_frame(Frame(Kind.BACKWARD, 3, 7, 2, 0.0, (_A, _A * 0.1)), "fp16"),
    encode_frame(Frame(Kind.OUTPUT, 3, 7, 1, 0.0, (_A,)), "int8"),
    encode_frame(Frame(Kind.HOLDINGS, 3, 0, 1)),
    encode_frame(Frame(Kind.EVAL, 3, 1, 3, 0.0, (_A, torch.randint(0, 9, (2, 3), generator=_G))), "fp32"),
    encode_frame(Frame(Kind.SCORE, 3, 1, 3, 2.25, (torch.tensor([4, 6]),))),
]

TARGETS = [FuzzTarget("wire.activations", lambda data: decode_frame(data, _LIMITS), (ActivationError,), _SEEDS)]


def _replicas() -> list:
    """A tiny transformer_lm's two stages, each served (no host needed: nothing is sent)."""
    from p2ptrain.models._registry import build_model
    from p2ptrain.pipeline import partition, StageReplica

    cut = partition(build_model("transformer_lm", {"vocab_size": 9, "context": 3, "width": 8, "depth": 2, "heads": 2},
                                seed=0), 2)
    loss = lambda logits, y: torch.nn.functional.cross_entropy(logits.reshape(-1, 9), y.reshape(-1).long())  # noqa: E731
    return [StageReplica(None, stage, loss, senders=(), evaluators=("e",)) for stage in cut]  # type: ignore[arg-type]


_EVAL_REPLICAS: list = []


def _answer_eval(data: bytes) -> None:
    """A hostile EVAL as a replica takes it: decoded, checked (its kind, tensors, stage, step), then
    computed; what the replica catches and refuses (a tensor the stage cannot take) is declared."""
    if not _EVAL_REPLICAS:
        _EVAL_REPLICAS.extend(_replicas())
    frame = decode_frame(data, _LIMITS)
    if frame.kind != Kind.EVAL or frame.stage > 1:
        return
    replica = _EVAL_REPLICAS[frame.stage]
    replica.weights_step = frame.step
    if replica._problem(frame) is None:
        encode_frame(replica._compute(frame, "e")[0])


_EVAL_SEEDS = [
    encode_frame(Frame(Kind.EVAL, 3, 1, 0, 0.0, (torch.randint(0, 9, (2, 3), generator=_G),))),
    encode_frame(Frame(Kind.EVAL, 3, 1, 1, 0.0, (torch.randn(2, 3, 8, generator=_G), torch.randint(0, 9, (2, 3), generator=_G)))),
]
TARGETS.append(FuzzTarget("pipeline.replica_eval", _answer_eval, (ActivationError, AssertionError, RuntimeError,
                                                                  ValueError, IndexError), _EVAL_SEEDS))
