"""The parts of one member's run of one task: ``TaskRun`` routes the task's messages to the part whose
job they are (leading, spans, attesting, resync, resume, the data feed) and reports its status; they
share a ``RunState``; the run's files (the chain, the feedback residual, the latest term voted in)
live here too, in the folder a ``RunDir`` names. It wires the protocol's decisions and the
training's numerics to the node; it may import every package below it, and only ``services`` and
above import it.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.run._run_dir import record_naming as record_naming, RunDir as RunDir
    from p2ptrain.run._run_state import RunState as RunState
    from p2ptrain.run._spans import HOP_TIMEOUT_S as HOP_TIMEOUT_S
    from p2ptrain.run._stage_checkpoints import initial_manifest as initial_manifest
    from p2ptrain.run._stage_local_sgd import LocalSGDStagedTrainer as LocalSGDStagedTrainer
    from p2ptrain.run._stage_trainer import StagedTrainer as StagedTrainer
    from p2ptrain.run._task_run import TaskRun as TaskRun
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
