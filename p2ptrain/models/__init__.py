"""What a model is, as data: the registry of model builders a task may name (a task names a builder and
its checked keyword arguments, never code; builders are built in or come from installed packages'
``p2ptrain.models`` entry points), where a model can be cut into pipeline stages (its pieces, on the
meta device), and the architecture card of a user's own module (its
CID, the fingerprint, names one architecture exactly). Imports only ``base``.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.models._fingerprint import (
        card_bytes as card_bytes,
        card_from_bytes as card_from_bytes,
        card_of as card_of,
        CardError as CardError,
        first_difference as first_difference,
        MAX_CARD_BYTES as MAX_CARD_BYTES,
    )
    from p2ptrain.models._plugins import (
        ENTRY_POINT_GROUP as ENTRY_POINT_GROUP,
        MissingBuilder as MissingBuilder,
        Origin as Origin,
        PLUGINS as PLUGINS,
    )
    from p2ptrain.models._fit import CHECKED_BUILDERS as CHECKED_BUILDERS, input_problem as input_problem
    from p2ptrain.models._model_error import ModelError as ModelError
    from p2ptrain.models._pieces import (
        balanced_cut as balanced_cut,
        builds_by_piece as builds_by_piece,
        Cut as Cut,
        cut_at as cut_at,
        cut_pieces as cut_pieces,
        InitialPieces as InitialPieces,
        LMBlock as LMBlock,
        MAX_PIPELINED_PARAMETERS as MAX_PIPELINED_PARAMETERS,
        PartitionError as PartitionError,
        Piece as Piece,
        pieces_of as pieces_of,
        piece_sizes as piece_sizes,
        stage_sizes as stage_sizes,
        tied_across as tied_across,
        whole_model_cap as whole_model_cap,
    )
    from p2ptrain.models._hf import (
        CausalLM as CausalLM,
        check_hf_config as check_hf_config,
        HF_MODEL as HF_MODEL,
        HF_REFUSED as HF_REFUSED,
        hf_config as hf_config,
        hf_settings as hf_settings,
        import_transformers as import_transformers,
    )
    from p2ptrain.models._registry import (
        Arg as Arg,
        Builder as Builder,
        build_model as build_model,
        builders as builders,
        check_model as check_model,
        file_bytes_bound as file_bytes_bound,
        lookup as lookup,
        HEADER_PER_TENSOR as HEADER_PER_TENSOR,
        HEADER_SLACK as HEADER_SLACK,
        MAX_MODEL_FILE_BYTES as MAX_MODEL_FILE_BYTES,
        MAX_PARAMETERS as MAX_PARAMETERS,
        meta_model as meta_model,
        model_file_limit as model_file_limit,
        TinyLM as TinyLM,
    )
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
