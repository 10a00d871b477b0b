"""The task spec: what to train, on what data, how, with how many peers (_spec.py). Strict parsing of
the TOML a person writes and of the canonical JSON bytes stored by CID (_parse.py: one ``TaskError``
naming the field), the demo's task file, and the example task files shipped as package data
(_examples.py). Both the coordination protocol and the training read it; it imports ``base``,
``wire``, ``ipfs`` (CIDs) and ``models``.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.task._cuts import (
        cost_cut as cost_cut,
        cut_problem as cut_problem,
        parameter_cut as parameter_cut,
        piece_parameters as piece_parameters,
        stage_parameters as stage_parameters,
    )
    from p2ptrain.task._demo_task import TASK_TEMPLATE as TASK_TEMPLATE
    from p2ptrain.task._examples import example_names as example_names, example_task as example_task
    from p2ptrain.task._fields import TaskError as TaskError
    from p2ptrain.task._parse import (
        load_task as load_task,
        NoBuilder as NoBuilder,
        parse_task as parse_task,
        read_task as read_task,
        task_bytes as task_bytes,
        task_from_bytes as task_from_bytes,
    )
    from p2ptrain.task._spec import (
        CompressionSpec as CompressionSpec,
        MAX_STAGES as MAX_STAGES,
        MAX_TASK_BYTES as MAX_TASK_BYTES,
        member_device as member_device,
        OuterSpec as OuterSpec,
        PipelineSpec as PipelineSpec,
        Task as Task,
        total_steps as total_steps,
        unmet_requirement as unmet_requirement,
        USER_MODEL as USER_MODEL,
    )
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
