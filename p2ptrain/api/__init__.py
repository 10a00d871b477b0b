"""The Python API for the user's own module and loop: ``p2ptrain.Optimizer``, ``p2ptrain.train``,
``p2ptrain.load_state`` (re-exported by ``p2ptrain``).
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.api._load import load_state as load_state
    from p2ptrain.api._optimizer import Optimizer as Optimizer, RunFinished as RunFinished
    from p2ptrain.api._train import train as train, TrainResult as TrainResult
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
