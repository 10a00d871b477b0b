"""The numerics of one member: the trainer (local gradients, the averaged step, evaluation, state
bytes), optimizers, batches, local SGD (DiLoCo) with its outer optimizer, one round over the
collective (``run_round``), the trainer of a run of the user's own module (fed by the user's loop),
and ``load_model``. It follows the protocol's plans and writes its records' bytes, so it imports
``protocol`` (never the reverse), and ``base``, ``wire``, ``ipfs``, ``data``, ``collective``,
``models`` and ``task``.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.training._batches import (
        batched as batched,
        batches_forever as batches_forever,
        evaluate_batches as evaluate_batches,
        loss_and_hits as loss_and_hits,
        PositionedBatches as PositionedBatches,
    )
    from p2ptrain.training._loading import (
        describe_model_file as describe_model_file,
        load_model as load_model,
        model_from_bytes as model_from_bytes,
    )
    from p2ptrain.training._pretrained import (
        config_snippet as config_snippet,
        export_pretrained as export_pretrained,
        import_pretrained as import_pretrained,
        PretrainedError as PretrainedError,
    )
    from p2ptrain.training._local_sgd import (
        inner_lr as inner_lr,
        LocalSGDTrainer as LocalSGDTrainer,
        new_trainer as new_trainer,
        step_inner as step_inner,
        zero_unless_finite as zero_unless_finite,
    )
    from p2ptrain.training._outer import (
        MOMENTUM_KEY as MOMENTUM_KEY,
        OuterOptimizer as OuterOptimizer,
    )
    from p2ptrain.training._optimizers import (
        lr_at as lr_at,
        slow_on_sparse as slow_on_sparse,
        warm_up_torch as warm_up_torch,
    )
    from p2ptrain.training._sync import (
        PlanAverager as PlanAverager,
        round_spec as round_spec,
        RoundTimings as RoundTimings,
        run_round as run_round,
    )
    from p2ptrain.training._trainer import (
        Average as Average,
        module_device as module_device,
        resolve_device as resolve_device,
        StepResult as StepResult,
        Trainer as Trainer,
        TrainerError as TrainerError,
    )
    from p2ptrain.training._trainer_error import DeviceError as DeviceError
    from p2ptrain.training._trainer_state import StateSnapshot as StateSnapshot
    from p2ptrain.training._stage_files import model_file as model_file
    from p2ptrain.training._stage_manifest import (
        check_stage_signatures as check_stage_signatures,
        is_manifest as is_manifest,
        ManifestError as ManifestError,
        manifest_bytes as manifest_bytes,
        MAX_MANIFEST_BYTES as MAX_MANIFEST_BYTES,
        read_manifest as read_manifest,
        stage_file_cids as stage_file_cids,
        stage_signatures_problem as stage_signatures_problem,
        StageFile as StageFile,
    )
    from p2ptrain.training._user_trainer import (
        GradientBridge as GradientBridge,
        StepSkipped as StepSkipped,
        UserLocalSGDTrainer as UserLocalSGDTrainer,
        UserTrainer as UserTrainer,
    )
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
