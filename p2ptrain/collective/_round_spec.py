"""What one all-reduce round is: its options, checked once, passed down whole.

A :class:`RoundSpec` is built once (by the trainer's side from the task's ``[compression]``:
:func:`p2ptrain.training._sync.round_spec`, or by a caller of :class:`~p2ptrain.collective.Collective`)
and handed through the reducer, the round and the algorithms unchanged: no layer re-checks or
unpacks it into loose arguments. Every member of a round must use the same spec except for the
timeouts (the rest is in the round's digest: a member that differs fails the round at once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from p2ptrain.collective._failures import CollectiveError
from p2ptrain.collective._ring import FLOAT_DTYPES
from p2ptrain.collective._robust import ROBUST_RULES
from p2ptrain.wire.quantization import KINDS

OPS = ("mean", "sum")


@dataclass(frozen=True)
class RoundSpec:
    """The options of an all-reduce round; a :class:`CollectiveError` on construction if any is bad."""

    op: str = "mean"  # the members' mean, or their sum
    # The top share of entries each member sends (sliced CLT-k below 1.0; 1.0: the exact dense all-reduce).
    density: float = 1.0
    # How the values of a sparse round travel (float32, float16, bfloat16); None: the tensor's own dtype.
    value_dtype: torch.dtype | None = None
    # "clip": each contribution's norm is clipped to the round's median (p2ptrain.collective._robust).
    robust: str = "none"
    # "int8" or "2bit": a sparse round's values travel quantized and all-gathered (collective.quantized).
    quantize: str | None = None
    # The share of a robust round's chunks that their verifier recomputes, drawn after each owner
    # signed its result (p2ptrain.collective._sampling); 1.0: every chunk, every round.
    check_fraction: float = 1.0
    timeout: float = 5.0  # bounds every hop
    start_timeout: float | None = None  # bounds waiting for the neighbours to join (None: timeout)

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise CollectiveError(f"op must be one of {OPS}, got {self.op!r}")
        if not 0.0 < self.density <= 1.0:
            raise CollectiveError(f"density must be in (0, 1], got {self.density}")
        if self.value_dtype is not None and self.value_dtype not in FLOAT_DTYPES:
            raise CollectiveError(f"unsupported value dtype {self.value_dtype}")
        if self.robust not in ROBUST_RULES:
            raise CollectiveError(f"robust must be one of {ROBUST_RULES}, got {self.robust!r}")
        if self.quantize is not None and (self.quantize not in KINDS or self.density >= 1.0):
            raise CollectiveError(f"quantize={self.quantize!r} is not supported (int8 or 2bit, with density < 1)")
        if not 0.0 < self.check_fraction <= 1.0:
            raise CollectiveError(f"check_fraction must be in (0, 1], got {self.check_fraction}")
        if self.check_fraction < 1.0 and (self.robust == "none" or self.quantize is not None):
            raise CollectiveError("check_fraction < 1 samples the chunks a robust round's owners reduce: it needs "
                                  "robust='clip' and values that are not quantized (those have no owner)")
        if not self.timeout > 0 or not (self.start_timeout is None or self.start_timeout > 0):
            raise CollectiveError("timeouts must be positive")

    @property
    def average(self) -> bool:
        return self.op == "mean"

    @property
    def join_timeout(self) -> float:
        """How long to wait for the neighbours to join the round."""
        return self.start_timeout or self.timeout

    def values_of(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the values of a sparse round over a ``dtype`` tensor travel in."""
        return self.value_dtype or dtype
