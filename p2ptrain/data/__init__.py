"""Datasets by CID: manifests, shards, sources, and the ``IPFSDataset`` PyTorch loader.

``IPFSDataset`` is imported lazily so that reading a manifest (``p2ptrain dataset info``) does not pay
for importing torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["IPFSDataset"]


def __getattr__(name: str) -> Any:
    if name == "IPFSDataset":
        from p2ptrain.data.dataset import IPFSDataset

        return IPFSDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
