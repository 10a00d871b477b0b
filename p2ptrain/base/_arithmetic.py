"""Which arithmetic a member's steps use: what decides whether two members compute the same bits.

Members attest a checkpoint by hashing their own weights, so every member must take the same
optimizer step to the same bits from the same averaged gradient. Elementwise IEEE operations are
correctly rounded wherever they run, but torch's CPU kernels are compiled once per instruction set
and picked at start (``ATEN_CPU_CAPABILITY``): the vectorized ones fuse multiply-adds (one
rounding), the scalar ones do not (two). On this project's AMD EPYC machine (torch 2.13.0, one
thread, the same inputs) ``lerp``, ``addcmul`` and ``add(alpha=...)`` give different bits under
``DEFAULT`` than under ``AVX2``, and so do Adam's and SGD-with-momentum's steps; ``AVX2`` and
``AVX512`` agree with each other (docs/deploy.md, "Which machines compute the same bits"). A GPU
computes with its own kernels again. This names the arithmetic: every node advertises its own in
its heartbeats (``Capabilities.arithmetic``, shown by ``node peers``), and a member whose state
turned out not to be the confirmed one names it in its log.
"""

from __future__ import annotations

import torch


def arithmetic_of(device: torch.device) -> str:
    """``device``'s arithmetic as a member's log names it: the torch release and, on the CPU, the
    kernels torch picked (``DEFAULT`` is the scalar set, without fused multiply-adds); on a GPU
    its name."""
    release = torch.__version__.split("+", 1)[0]
    if device.type == "cuda":
        return f"torch {release} on {torch.cuda.get_device_name(device)}"
    return f"torch {release} on the CPU with {torch.backends.cpu.get_cpu_capability()} kernels"
