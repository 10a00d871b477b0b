"""p2ptrain: peer-to-peer training of PyTorch models over libp2p and IPFS.

The Python API, imported lazily (``import p2ptrain`` stays cheap for the command line):

- :func:`load_model` — a published model by CID (or from a file) as a ready ``torch.nn.Module``;
- :class:`IPFSDataset` — a PyTorch dataset that streams verified shards by CID;
- ``serve(model_cid, ...)`` — serve a model over HTTP/JSON, batched (``p2ptrain.serve.predict``: the client).
"""

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "load_model": ("p2ptrain.training.loading", "load_model"),
    "IPFSDataset": ("p2ptrain.data.dataset", "IPFSDataset"),
}

__all__ = ["IPFSDataset", "__version__", "load_model", "serve"]


def __getattr__(name: str) -> Any:
    if name == "serve":  # the package p2ptrain.serve, callable as serve(model_cid, ...)
        return __import__("p2ptrain.serve", fromlist=["serve"])
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(__import__(module, fromlist=[attr]), attr)
    raise AttributeError(f"module 'p2ptrain' has no attribute {name!r}")
