"""The task's optimizer and its learning-rate schedule: the same kernels and the same rate on every
member, since every member must take a bitwise-identical step from the same averaged gradient."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from p2ptrain.task import Task


def lr_at(task: Task, step: int, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) under the task's schedule."""
    assert task.optimizer is not None, "a run of the user's own model brings its optimizer (and its lr)"
    base, sched = task.optimizer.lr, task.schedule
    if sched.name != "constant" and step < sched.warmup_steps:
        return base * (step + 1) / sched.warmup_steps
    if sched.name == "cosine":
        span = max(1, total_steps - sched.warmup_steps)
        progress = min(1.0, (step - sched.warmup_steps) / span)
        floor = base * sched.min_lr_ratio
        return floor + (base - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return base


def warm_up_torch() -> None:
    """Pay torch's lazy imports: the first optimizer a process builds imports ``torch._dynamo`` (4 s
    of CPU here). Call it in a worker thread before a run touches torch on the event loop: while the
    import runs, any call into torch that needs ``torch._dynamo`` waits on its import lock, so done on
    the loop (or raced by it) it silenced nodes long enough for their peers to mark them gone. From a
    worker thread the loop keeps answering (0.05 s at the 99th percentile, 0.5 s at most, at load 15).
    Once per process; later calls build one throwaway optimizer (microseconds)."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def build_optimizer(task: Task, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The task's optimizer with the fused kernel (``fused=True``) on every member, so all members run
    the same kernels whatever torch would pick by default for their hardware.

    Fused rather than the single-tensor path: one pass over each parameter instead of a dozen
    elementwise ops, and no slow path on zeros. A sparse average leaves ~99% of Adam's second moment
    at exactly 0, where torch's vectorized sqrt is ~12x slower than on other values (28 vs 2.3 ms on
    4.3M floats): an Adam step of a 4.3M-parameter model took 26 ms single-tensor, 3.4 ms fused.
    """
    o = task.optimizer
    assert o is not None, "a run of the user's own model brings its optimizer"
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum or 0.0, weight_decay=o.weight_decay,
                               fused=True)
    cls = torch.optim.Adam if o.name == "adam" else torch.optim.AdamW
    assert o.beta1 is not None and o.beta2 is not None and o.eps is not None
    return cls(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
               fused=True)


def slow_on_sparse(optimizer: torch.optim.Optimizer, density: float) -> bool:
    """Whether a user's ``optimizer`` takes the slow path above (build_optimizer) on the averages of a
    run of ``density``: an unfused Adam or AdamW under a sparse average took 1.6-2x the time per step
    at 4.3M parameters (docs/benchmarks.md, issue 29)."""
    return density < 1.0 and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) \
        and not optimizer.defaults.get("fused")
