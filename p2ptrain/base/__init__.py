"""The leaves every layer may use; they import nothing of ours but each other.

Atomic file writes, the bounded JSON parser (:mod:`p2ptrain.base.boundedjson`, a public submodule:
``boundedjson.loads``), ``UserError``, how log lines name peers, the home folder and its Ed25519 key,
one-pass tensor checks, the checked header of a safetensors file from the network, the arithmetic a
member's steps use, round-time histograms, the token-bucket refill, ``HOST:PORT``, one glibc arena.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.base import boundedjson as boundedjson
    from p2ptrain.base._arithmetic import arithmetic_of as arithmetic_of
    from p2ptrain.base._atomic import write_atomic as write_atomic
    from p2ptrain.base._errors import (
        ArgumentError as ArgumentError,
        command_line_words as command_line_words,
        first_leaf as first_leaf,
        UserError as UserError,
    )
    from p2ptrain.base._hostport import (
        AddressError as AddressError,
        format_host_port as format_host_port,
        parse_host_port as parse_host_port,
    )
    from p2ptrain.base._home import default_home as default_home
    from p2ptrain.base._identity import (
        load_or_create_identity as load_or_create_identity,
        peer_id_of as peer_id_of,
    )
    from p2ptrain.base._logs import (
        count_rejection as count_rejection,
        fmt_bytes as fmt_bytes,
        fmt_s as fmt_s,
        formatter as formatter,
        short_id as short_id,
    )
    from p2ptrain.base._malloc import use_one_arena as use_one_arena
    from p2ptrain.base._round_histograms import HistogramSnapshot as HistogramSnapshot, RoundHistograms as RoundHistograms
    from p2ptrain.base._safetensors_header import read_header as read_header, TensorFileError as TensorFileError
    from p2ptrain.base._tensors import (
        all_finite as all_finite,
        flat_params as flat_params,
        large_empty as large_empty,
        load_flat_params as load_flat_params,
        zero_fill as zero_fill,
    )
    from p2ptrain.base._strike_windows import StrikeWindows as StrikeWindows
    from p2ptrain.base._token_bucket import refilled as refilled
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
