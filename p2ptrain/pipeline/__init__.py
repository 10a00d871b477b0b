"""Pipeline stages across peers (issue 31, docs/pipeline.md): a model cut into contiguous stages
balanced by parameter count, and the stage protocol that carries a microbatch's activations forward
through one replica of every stage and its gradients back, rerouting around replicas that die.
Imports ``base``, ``wire``, ``net``, ``models`` and ``collective``.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.pipeline._averaging import sum_stage_gradients as sum_stage_gradients
    from p2ptrain.pipeline._channels import ChannelPool as ChannelPool
    from p2ptrain.pipeline._deadlines import HopDeadlines as HopDeadlines
    from p2ptrain.pipeline._evaluation import (
        Evaluation as Evaluation,
        EvaluationFailed as EvaluationFailed,
        evaluate_stages as evaluate_stages,
    )
    from p2ptrain.pipeline._driver import (
        DoubleCounted as DoubleCounted,
        Driver as Driver,
        Outvoted as Outvoted,
        PipelineError as PipelineError,
        StageUnavailable as StageUnavailable,
    )
    from p2ptrain.models import (  # where a model is cut lives with the models (a task's parse checks it)
        balanced_cut as balanced_cut,
        Cut as Cut,
        PartitionError as PartitionError,
        pieces_of as pieces_of,
    )
    from p2ptrain.pipeline._opinions import is_checked as is_checked
    from p2ptrain.pipeline._partition import partition as partition, partition_at as partition_at, Stage as Stage
    from p2ptrain.pipeline._replica import (KEEP_GRAPHS as KEEP_GRAPHS, MAX_STREAMS_PER_PEER as MAX_STREAMS_PER_PEER,
                                            PROTOCOL as PROTOCOL, serve_requests as serve_requests,
                                            StageReplica as StageReplica)
    from p2ptrain.pipeline._request_shapes import request_shapes as request_shapes, RequestShapes as RequestShapes
    from p2ptrain.pipeline._stragglers import Stragglers as Stragglers
    from p2ptrain.pipeline._wiring import Wiring as Wiring
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
