"""Every format we exchange with peers: signed, versioned, schema-checked, size-limited pubsub
messages (the codec, the message schemas), the collective's binary frames (which need torch) and the
parts members put in a gather (a step summary's driver entry, a signed stage statement). No pickle.
docs/mesh.md's table lists each, with the module that declares it. Imports only ``base``.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.wire._codec import (
        decode as decode,
        DecodeError as DecodeError,
        encode as encode,
        peek_type as peek_type,
        Signed as Signed,
    )
    from p2ptrain.wire._frames import (
        abort_frame as abort_frame,
        busy_frame as busy_frame,
        DIGEST_BYTES as DIGEST_BYTES,
        DRAW_BYTES as DRAW_BYTES,
        DTYPES as DTYPES,
        ENTRY_BYTES as ENTRY_BYTES,
        HEADER as HEADER,
        FrameError as FrameError,
        Header as Header,
        hello_frame as hello_frame,
        is_busy as is_busy,
        Kind as Kind,
        MAX_FIRST_FRAME as MAX_FIRST_FRAME,
        NORM_BYTES as NORM_BYTES,
        norms_bytes as norms_bytes,
        parse_draw as parse_draw,
        parse_norms as parse_norms,
        parse_abort as parse_abort,
        parse_header as parse_header,
        Phase as Phase,
        PROTOCOL as PROTOCOL,
        ready_frame as ready_frame,
        round_digest as round_digest,
        Said as Said,
        SIGNATURE_BYTES as SIGNATURE_BYTES,
        statement as statement,
    )
    from p2ptrain.wire._limits import (
        MAX_BUILDER_NAME_LEN as MAX_BUILDER_NAME_LEN,
        MAX_BUILDERS as MAX_BUILDERS,
        MAX_MESSAGE_BYTES as MAX_MESSAGE_BYTES,
    )
    from p2ptrain.wire._messages import (
        Attestation as Attestation,
        Capabilities as Capabilities,
        ConfirmedRecord as ConfirmedRecord,
        CoordinatorBeat as CoordinatorBeat,
        Goodbye as Goodbye,
        HeadRequest as HeadRequest,
        Heartbeat as Heartbeat,
        message as message,
        MessageRegistry as MessageRegistry,
        MESSAGES as MESSAGES,
        ModelRecord as ModelRecord,
        ModelServed as ModelServed,
        RoundFailed as RoundFailed,
        RoundPlan as RoundPlan,
        SignedAttestation as SignedAttestation,
        SignedModelRecord as SignedModelRecord,
        SignedVote as SignedVote,
        TaskAnnounce as TaskAnnounce,
        TaskCancel as TaskCancel,
        TaskHead as TaskHead,
        TaskResume as TaskResume,
        Vote as Vote,
        VoteRequest as VoteRequest,
    )
    from p2ptrain.wire._replay import ReplayGuard as ReplayGuard
    from p2ptrain.wire._schema import from_plain as from_plain, SchemaError as SchemaError, to_plain as to_plain
    from p2ptrain.wire._stage_statements import (
        MAX_STATEMENT_BYTES as MAX_STATEMENT_BYTES,
        read_statement as read_statement,
        SignedStageStatement as SignedStageStatement,
        StageStatement as StageStatement,
        statement_bytes as statement_bytes,
        StatementError as StatementError,
    )
    from p2ptrain.wire._summary_entries import (
        MAX_ACCUSED as MAX_ACCUSED,
        MAX_SUMMARY_ENTRY_BYTES as MAX_SUMMARY_ENTRY_BYTES,
        MAX_TIMED_ENTRY_BYTES as MAX_TIMED_ENTRY_BYTES,
        read_summary_entry as read_summary_entry,
        summary_entry_bytes as summary_entry_bytes,
        SummaryEntry as SummaryEntry,
    )
    from p2ptrain.wire._topics import MESH_TOPIC as MESH_TOPIC, task_topic as task_topic, TASKS_TOPIC as TASKS_TOPIC
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
