"""The outer optimizer of local-SGD mode: one identical step on every member per round.

DiLoCo (Douillard et al. 2023): each member takes H inner steps from the shared weights
``theta``; the *pseudo-gradient* ``delta = theta - theta_after_H_steps`` is averaged across members
and fed to an outer optimizer as if it were a gradient. DiLoCo's outer optimizer is SGD with
Nesterov momentum (lr 0.7, momentum 0.9); ``average`` (lr 1, no momentum) is plain model averaging,
federated averaging's update (the new weights are the members' mean).

Pure and flat: the weights, the averaged pseudo-gradient and the momentum are single float32
vectors, the update is a fixed sequence of elementwise ops (the same as ``torch.optim.SGD`` with
``nesterov=True``: ``buf = mu * buf + delta``, ``theta -= lr * (delta + mu * buf)``). Given the same
inputs, every member computes the same bits, which is what lets members attest a checkpoint by
hashing their own weights in this mode too.
"""

from __future__ import annotations

import torch

from p2ptrain.task import OuterSpec

# The name of the momentum tensor in a checkpoint's optimizer file (the outer state is all that
# file holds in local-SGD mode: the inner optimizers' states differ from member to member).
MOMENTUM_KEY = "outer.momentum"


class OuterError(ValueError):
    """An outer state that does not fit this optimizer (wrong shape, dtype or names)."""


class OuterOptimizer:
    """The outer step over a model's flat weights; its state is the momentum (Nesterov only)."""

    def __init__(self, spec: OuterSpec, numel: int) -> None:
        self.spec = spec
        self.numel = numel
        self.nesterov = spec.optimizer == "nesterov"
        self.lr = spec.lr if spec.lr is not None else 1.0
        self.mu = spec.momentum if spec.momentum is not None else 0.0
        self.momentum = torch.zeros(numel, dtype=torch.float32) if self.nesterov else None

    def step(self, theta: torch.Tensor, delta: torch.Tensor) -> None:
        """Update ``theta`` (flat float32, in place) with the averaged pseudo-gradient ``delta``."""
        if theta.shape != (self.numel,) or delta.shape != (self.numel,):
            raise OuterError(f"outer step over {self.numel} weights got {tuple(theta.shape)} and {tuple(delta.shape)}")
        if self.momentum is None:
            theta.sub_(delta)
            return
        self.momentum.mul_(self.mu).add_(delta)
        update = torch.add(delta, self.momentum, alpha=self.mu)
        theta.add_(update, alpha=-self.lr)

    def state(self) -> dict[str, torch.Tensor]:
        """The outer state as named tensors (shared by every member: stored in the checkpoint)."""
        return {} if self.momentum is None else {MOMENTUM_KEY: self.momentum}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the outer state from a checkpoint's tensors (exactly :meth:`state`'s names)."""
        expected = set(self.state())
        if set(tensors) != expected:
            extra = sorted(set(tensors) ^ expected)
            raise OuterError(f"outer state has tensors {sorted(tensors)}, expected {sorted(expected)} ({extra[0]})")
        if self.momentum is not None:
            value = tensors[MOMENTUM_KEY]
            if value.dtype != torch.float32 or value.shape != (self.numel,):
                raise OuterError(f"{MOMENTUM_KEY} has {value.dtype} {tuple(value.shape)}, expected float32 ({self.numel},)")
            self.momentum = value.detach().to("cpu", copy=True).contiguous()

    def state_bytes_bound(self) -> int:
        """The most tensor bytes :meth:`state` can take."""
        return 4 * self.numel if self.nesterov else 0
