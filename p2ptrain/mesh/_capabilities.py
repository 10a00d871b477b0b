"""What this machine offers, advertised in every heartbeat so tasks can pick peers that fit.

Importing torch costs ~3 s on a small machine, so a node starts heartbeating with a cheap probe
(CPU count, free RAM from /proc/meminfo, the NVIDIA driver's /proc entries) and refines the GPU part
with ``torch.cuda`` in a worker thread; the next heartbeat carries the refined answer.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from p2ptrain import __version__
from p2ptrain.base import arithmetic_of
from p2ptrain.wire import Capabilities


def free_ram_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """Available memory as the kernel estimates it (MemAvailable), 0 where unknown."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _driver_gpu_name(root: Path = Path("/proc/driver/nvidia/gpus")) -> str | None:
    """The first GPU's model from the NVIDIA driver, without importing torch."""
    try:
        for info in sorted(root.glob("*/information")):
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def quick_capabilities() -> Capabilities:
    """A fast probe: no torch import."""
    gpu = _driver_gpu_name()
    return Capabilities(
        device="cuda" if gpu else "cpu",
        cpu_count=_cpu_count(),
        free_ram_bytes=free_ram_bytes(),
        version=__version__,
        gpu_name=gpu,
    )


def on_cpu(caps: Capabilities) -> Capabilities:
    """``caps`` of a node that trains on the CPU whatever GPU the machine has (``--device cpu``):
    peers choosing members for a ``cuda`` task must not count one that will refuse it."""
    return replace(caps, device="cpu", gpu_name=None, gpu_memory_bytes=None)


def torch_capabilities(device: str = "auto") -> Capabilities:
    """The full probe through torch.cuda (slow: run it in a worker thread), of the GPU that
    ``device`` (the node's ``--device``: auto, cpu, cuda or cuda:N) trains on; none for cpu."""
    import torch

    if device == "cpu":
        return replace(on_cpu(quick_capabilities()), arithmetic=arithmetic_of(torch.device("cpu")))
    gpu_name = gpu_memory = None
    kind, where = "cpu", torch.device("cpu")
    if torch.cuda.is_available():
        kind = "cuda"
        index = int(device.split(":", 1)[1]) if device.startswith("cuda:") else 0
        props = torch.cuda.get_device_properties(index)
        gpu_name, gpu_memory, where = props.name, int(props.total_memory), torch.device("cuda", index)
    return Capabilities(
        device=kind,
        cpu_count=_cpu_count(),
        free_ram_bytes=free_ram_bytes(),
        version=__version__,
        gpu_name=gpu_name,
        gpu_memory_bytes=gpu_memory,
        arithmetic=arithmetic_of(where),
    )


def refresh_ram(caps: Capabilities) -> Capabilities:
    """The same capabilities with free RAM measured now."""
    return replace(caps, free_ram_bytes=free_ram_bytes())
