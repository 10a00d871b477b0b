"""The Python API for the user's own module and loop: ``p2ptrain.Optimizer``, ``p2ptrain.train``,
``p2ptrain.load_state`` and ``p2ptrain.load_model`` (re-exported by ``p2ptrain``); and, re-exported from
``p2ptrain.services``, content by CID made local: the fetch paths that ``load_state`` and the CLI's commands share.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.services import (  # the fetch paths live in services/_fetching.py; the API's names stay
        ensure_local as ensure_local,
        EPHEMERAL_MESH_TIMEOUT_S as EPHEMERAL_MESH_TIMEOUT_S,
        fetch_progress as fetch_progress,
        fetch_through as fetch_through,
        find_latest as find_latest,
        home_holding as home_holding,
        node_answers as node_answers,
        NODE_PROBE_TIMEOUT_S as NODE_PROBE_TIMEOUT_S,
        PROGRESS_LINE_S as PROGRESS_LINE_S,
        split_shards as split_shards,
        with_ephemeral_node as with_ephemeral_node,
    )
    from p2ptrain.api._load import load_model as load_model, load_state as load_state
    from p2ptrain.net import check_listen as check_listen
    from p2ptrain.api._optimizer import Optimizer as Optimizer, RunFinished as RunFinished
    from p2ptrain.api._train import train as train, TrainResult as TrainResult
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
