"""The training layer's error: what a trainer, its batches or its evaluation cannot do.

Its own module (as collective/_failures.py is) so that the modules a trainer is built from
(:mod:`p2ptrain.training._batches`) raise the same type the runtime catches from the trainer.
"""

from __future__ import annotations


class TrainerError(RuntimeError):
    """The trainer cannot do what was asked (out of sync with the round, bad state, no data)."""
