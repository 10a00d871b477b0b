"""The training layer's error: what a trainer, its batches or its evaluation cannot do.

Its own module (as collective/_failures.py is) so that the modules a trainer is built from
(:mod:`p2ptrain.training._batches`) raise the same type the runtime catches from the trainer.
"""

from __future__ import annotations

from p2ptrain.base import ArgumentError


class TrainerError(RuntimeError):
    """The trainer cannot do what was asked (out of sync with the round, bad state, no data)."""


class DeviceError(ArgumentError, TrainerError):
    """A device to train or serve on that is not one (a typo, CUDA asked of a machine without it):
    an ArgumentError, so ``node start --device`` and ``serve(device=...)`` each name their own
    argument, and a TrainerError, which the runtime catches from a trainer."""
