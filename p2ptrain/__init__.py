"""p2ptrain: peer-to-peer training of PyTorch models over libp2p and IPFS.

The Python API, imported lazily (``import p2ptrain`` stays cheap for the command line):

- :class:`Optimizer` — wraps your ``torch.optim.Optimizer``: your own module, trained from your own
  loop across the peers of a run (``opt.step()`` after ``loss.backward()``); :class:`RunFinished`
  when the run reached its last step;
- :func:`train` — the one-call form over a dataset, returning a :class:`TrainResult`;
- :func:`load_state` — a confirmed model's weights (by CID, verified) into your own instance;
- :func:`load_model` — a published model by CID (or from a file) as a ready ``torch.nn.Module``;
- :class:`IPFSDataset` — a PyTorch dataset that streams verified shards by CID;
- ``serve(model_cid, ...)`` — serve a model over HTTP/JSON, batched (``p2ptrain.serve.predict``: the client).
"""

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Optimizer": ("p2ptrain.api", "Optimizer"),
    "RunFinished": ("p2ptrain.api", "RunFinished"),
    "TrainResult": ("p2ptrain.api", "TrainResult"),
    "train": ("p2ptrain.api", "train"),
    "load_state": ("p2ptrain.api", "load_state"),
    "load_model": ("p2ptrain.training.loading", "load_model"),
    "IPFSDataset": ("p2ptrain.data.dataset", "IPFSDataset"),
}

__all__ = ["IPFSDataset", "Optimizer", "RunFinished", "TrainResult", "__version__", "load_model", "load_state",
           "serve", "train"]


def __getattr__(name: str) -> Any:
    if name == "serve":  # the package p2ptrain.serve, callable as serve(model_cid, ...)
        return __import__("p2ptrain.serve", fromlist=["serve"])
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(__import__(module, fromlist=[attr]), attr)
    raise AttributeError(f"module 'p2ptrain' has no attribute {name!r}")
