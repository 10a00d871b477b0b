"""The Python API for the user's own module and loop: ``p2ptrain.Optimizer``, ``p2ptrain.train``,
``p2ptrain.load_state`` (re-exported by ``p2ptrain``)."""

from p2ptrain.api.optimizer import Optimizer, RunFinished

__all__ = ["Optimizer", "RunFinished"]
