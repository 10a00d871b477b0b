"""What a node advertises of its device: the GPU it trains on, and none with ``--device cpu``, so
that peers choosing members for a ``cuda`` task do not count one that will refuse it (found on the
first GPU run: a ``--device cpu`` node advertised the machine's H200)."""

from __future__ import annotations

from pathlib import Path

import torch

from p2ptrain.mesh import _capabilities as caps_probe
from p2ptrain.node import Node
from p2ptrain.services import TaskOptions, make_peer
from p2ptrain.wire import Capabilities

GPU_MACHINE = Capabilities(device="cuda", cpu_count=16, free_ram_bytes=1 << 36, version="test",
                           gpu_name="NVIDIA H200", gpu_memory_bytes=143_771 << 20)


def _advertised(home: Path, device: str) -> Capabilities:
    node = Node(home)
    node.membership.caps = GPU_MACHINE  # what the probe finds on a GPU machine
    make_peer(node, TaskOptions(device=device))
    return node.membership.heartbeat().caps


def test_a_node_that_trains_on_the_cpu_advertises_no_gpu_and_one_on_auto_keeps_it(tmp_path: Path) -> None:
    on_cpu = _advertised(tmp_path / "cpu", "cpu")
    assert (on_cpu.device, on_cpu.gpu_name, on_cpu.gpu_memory_bytes) == ("cpu", None, None)
    assert on_cpu.cpu_count == GPU_MACHINE.cpu_count
    assert _advertised(tmp_path / "auto", "auto") == GPU_MACHINE


def test_the_torch_probe_of_a_cpu_node_names_no_gpu() -> None:
    caps = caps_probe.torch_capabilities("cpu")
    assert (caps.device, caps.gpu_name, caps.gpu_memory_bytes) == ("cpu", None, None)
    assert caps.cpu_count >= 1 and caps.free_ram_bytes >= 0
    # The arithmetic its steps use, which members of one run must share (docs/deploy.md).
    assert caps.arithmetic == f"torch {torch.__version__.split('+')[0]} on the CPU with " \
        f"{torch.backends.cpu.get_cpu_capability()} kernels"

