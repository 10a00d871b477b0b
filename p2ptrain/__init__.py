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

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain import serve as serve
    from p2ptrain.api import (
        load_model as load_model,
        load_state as load_state,
        Optimizer as Optimizer,
        RunFinished as RunFinished,
        train as train,
        TrainResult as TrainResult,
    )
    from p2ptrain.data import IPFSDataset as IPFSDataset
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
    __all__ = sorted([*__all__, "__version__"])

__version__ = "0.1.0"
