"""The public names of each package, exactly (as httpx pins its ``__all__``): removing or renaming one
is a visible change to whoever imports it, so it shows here first. Each package keeps its code in
private modules (``_name.py``) and re-exports these from its ``__init__.py`` (p2ptrain/_exports.py says
how); a public submodule (``p2ptrain.base.boundedjson``) is listed by its name."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

EXPORTS: dict[str, list[str]] = {
    "p2ptrain": [
        "IPFSDataset", "Optimizer", "RunFinished", "TrainResult", "__version__", "load_model", "load_state", "serve",
        "train",
    ],
    "p2ptrain.api": [
        "EPHEMERAL_MESH_TIMEOUT_S", "NODE_PROBE_TIMEOUT_S", "Optimizer", "PROGRESS_LINE_S", "RunFinished", "TrainResult",
        "check_listen", "ensure_local", "fetch_progress", "fetch_through", "find_latest", "home_holding", "load_model",
        "load_state",
        "node_answers", "split_shards", "train", "with_ephemeral_node",
    ],
    "p2ptrain.base": [
        "AddressError", "ArgumentError", "HistogramSnapshot", "RoundHistograms", "StrikeWindows", "TensorFileError",
        "UserError",
        "all_finite", "arithmetic_of", "boundedjson", "command_line_words", "count_rejection", "default_home",
        "first_leaf", "flat_params", "fmt_bytes", "fmt_s", "format_host_port", "formatter", "large_empty",
        "load_flat_params", "load_or_create_identity", "parse_host_port", "peer_id_of", "read_header", "refilled",
        "short_id", "use_one_arena", "write_atomic", "zero_fill",
    ],
    "p2ptrain.collective": [
        "BadPayload", "Collective", "CollectiveError", "ErrorFeedback", "Misbehaved", "PROTOCOL", "PeerFailed",
        "RoundSpec", "RoundStats", "SparseAllReducer", "bucket_ks", "clip_scales", "contribution_norm", "digest_of",
        "reduce_chunk", "scaled", "signed_by",
    ],
    "p2ptrain.control": [
        "ChainEntry", "ControlClient", "ControlError", "ControlServer", "FINISHED", "NodeStatus", "Phase",
        "TaskStatus", "is_live", "ops", "socket_path",
    ],
    "p2ptrain.data": [
        "IPFSDataset", "MAX_MANIFEST_BYTES", "Manifest", "ManifestError", "Pixels", "SourceOptions", "TEXT_CONTEXT",
        "TensorFileError", "build_dataset", "build_source", "dataset_cids", "load_source", "parse_size",
        "read_header", "read_source",
    ],
    "p2ptrain.ipfs": [
        "BlockExchange", "BlockMismatch", "BlockStore", "CHUNK_SIZE", "CID", "ContentStore", "ContentUnavailable",
        "CorruptBlock", "DAG_PB", "DIRECT", "DagError", "DecodeError", "EmbeddedStore", "FetchError", "FetchStats",
        "FileTooLarge", "InvalidCID", "MAX_LINKS", "MAX_MESSAGE_SIZE", "PBNode", "PROTOCOLS", "PinFileError", "RAW",
        "UnixFSData", "cid_from_digest", "cid_str", "dag_bytes_limit", "decode_node", "decode_unixfs",
        "encode_file_leaf", "encode_file_node", "import_stream", "make_cid", "not_a_cid", "open_store", "parse_cid", "read_file",
        "requested_cid", "varint", "walk_dag",
    ],
    "p2ptrain.mesh": [
        "ContentRouting", "DEFAULT_SILENCE_HEARTBEATS", "Discovery", "M", "MAX_PROVIDERS_PER_QUERY", "Membership",
        "MessageRouter", "Rate", "derived_key", "keep_reservations", "parse_bootstrap",
    ],
    "p2ptrain.models": [
        "Arg", "Builder", "CHECKED_BUILDERS", "CardError", "CausalLM", "Cut", "ENTRY_POINT_GROUP", "HEADER_PER_TENSOR",
        "HEADER_SLACK",
        "HF_MODEL", "HF_REFUSED", "InitialPieces", "LMBlock", "MAX_CARD_BYTES", "MAX_MODEL_FILE_BYTES", "MAX_PARAMETERS",
        "MAX_PIPELINED_PARAMETERS", "MissingBuilder", "ModelError", "Origin",
        "PLUGINS", "PartitionError", "Piece", "TinyLM", "balanced_cut", "build_model", "builders", "builds_by_piece",
        "card_bytes",
        "card_from_bytes", "card_of", "check_hf_config", "check_model", "cut_at", "cut_pieces", "file_bytes_bound",
        "first_difference", "hf_config", "hf_settings", "import_transformers", "input_problem", "lookup",
        "meta_model",
        "model_file_limit", "piece_sizes", "pieces_of", "stage_sizes", "tied_across", "whole_model_cap",
    ],
    "p2ptrain.pipeline": [
        "ChannelPool", "Cut", "DoubleCounted", "Driver", "Evaluation", "EvaluationFailed", "HopDeadlines", "KEEP_GRAPHS",
        "MAX_STREAMS_PER_PEER", "Outvoted", "PROTOCOL", "PartitionError", "PipelineError", "RequestShapes", "Stage",
        "StageReplica", "StageUnavailable", "Stragglers", "Wiring", "balanced_cut", "evaluate_stages", "is_checked",
        "partition", "partition_at", "pieces_of", "request_shapes", "serve_requests", "sum_stage_gradients",
    ],
    "p2ptrain.net": [
        "Channel", "ChannelClosed", "ChannelError", "MessageTooLarge", "PubsubMessageTooLarge",
        "RELAY_CIRCUIT_BYTES_RANGE", "RELAY_CIRCUIT_S_RANGE", "RELAY_MAX_CIRCUIT_BYTES", "RELAY_MAX_CIRCUIT_S",
        "RELAY_MAX_RESERVATIONS", "RELAY_RESERVATIONS_RANGE", "Reachability", "Relaying", "STATUSES", "StreamGuard",
        "advertised_addrs", "bound_problem", "check_listen", "close_host", "has_direct_connection", "is_circuit", "make_host",
        "make_pubsub", "noise_only", "not_a_multiaddr", "open_channel", "over_relay", "publish_bytes", "relay_limits",
        "running_pubsub", "running_service", "serve_channels",
    ],
    "p2ptrain.node": [
        "CONFIG_FILE", "ContentService", "DEFAULT_MAX_FETCH_BYTES", "NODE_ARGS", "Node", "NodeConfig", "NodeProcess",
        "READY_TIMEOUT_S", "env_variable", "free_port", "port_range", "port_slice", "settings",
    ],
    "p2ptrain.protocol": [
        "ATTEST_TIMEOUT_S", "AssignmentError", "Attestations", "CANNOT_FOLLOW", "Chain", "ChainRules", "ClassClaims", "Classes",
        "Convictions", "Election", "ElectionConfig", "ElectionMessage", "Fork", "ForkAnswers", "HeadAsking", "HeadOffers",
        "HeldPlans", "Hold",
        "LoneFailures",
        "MAX_CHAIN_BYTES",
        "MAX_STATEMENT_BYTES", "Misconduct", "NO_TRAINING_DATA", "OUT_OF_STEP", "Participation", "RECUT_MARGIN",
        "RecordError",
        "RoundBook",
        "RuleBreak", "SignedStageStatement", "StageStatement", "StageTimes", "StageVerdict", "StatementError", "Status",
        "StepAborts",
        "Tally",
        "View",
        "assign", "attest", "audit", "bits_class", "buffers_round_id",
        "chain_lines", "check_key_message", "check_statement", "convicted",
        "election_problem",
        "entry_from_bytes",
        "inner_round_id", "is_checkpoint",
        "load_model_bytes", "measured_costs", "measured_cut", "median_micros", "model_bytes", "model_tensors", "orphaned_stages",
        "own_round_lost", "owner_seed", "parse_entry", "piece_costs", "plan_cut", "plan_order",
        "read_chain",
        "read_model_card", "read_statement", "read_tensors", "receive_noting", "record_confirmed", "record_id", "refuse_report",
        "round_completed",
        "round_id", "round_seed", "shard_of", "sign_record",
        "sign_statement", "signed_entry_problem", "signing", "span_confirmed", "stage_moves", "stage_rings", "stage_round_id",
        "stage_verdicts", "state_bytes", "statement_bytes", "tensors_bytes", "term_candidate", "throughput", "witness_problem",
        "witnessable", "witnessed_chain_limits", "won_alone",
        "write_state_file",
    ],
    "p2ptrain.run": [
        "HOP_TIMEOUT_S", "LocalSGDStagedTrainer", "RunDir", "RunState", "StagedTrainer", "TaskRun", "initial_manifest",
        "record_naming",
    ],
    "p2ptrain.serve": [
        "MAX_CONNECTIONS", "ServeError", "Server", "TemporaryFollower", "open_model", "predict", "serve",
    ],
    "p2ptrain.services": [
        "EPHEMERAL_MESH_TIMEOUT_S", "Fetcher", "KnownTask", "LatestFinder", "MAX_SEEN_HEADS", "MetricsServer",
        "NODE_PROBE_TIMEOUT_S", "PROGRESS_LINE_S", "Peer", "SERVED_EVERY_S", "TaskOptions", "check_url", "ensure_local",
        "fetch_progress", "fetch_through", "find_latest", "home_holding", "make_fetcher", "make_peer", "node_answers",
        "parse_address", "run_state_roots", "split_shards", "with_ephemeral_node",
    ],
    "p2ptrain.task": [
        "CompressionSpec", "MAX_STAGES", "MAX_TASK_BYTES", "NoBuilder", "OuterSpec", "PipelineSpec", "TASK_TEMPLATE", "Task",
        "TaskError", "USER_MODEL", "cost_cut", "cut_problem", "example_names", "example_task", "load_task",
        "member_device", "parameter_cut", "parse_task",
        "piece_parameters", "read_task", "stage_parameters",
        "task_bytes", "task_from_bytes", "total_steps", "unmet_requirement",
    ],
    "p2ptrain.testing": [
        "CLI_TIMEOUT_S", "CONNECT_TIMEOUT_S", "Changes", "DIGITS_TASK", "EOS", "EmulatedNat", "EmulatedWan",
        "ForkedProcess", "IFACE", "LOOPBACK", "LocalHost", "LocalPeers", "NodeProcess", "PEER_STOP_TIMEOUT_S",
        "STDLIB_FILES", "SUBSCRIBED_TIMEOUT_S", "ScriptMember", "WAIT_FALLBACK_S", "WanError", "WanPeer",
        "attestations_for", "cleanup_stale", "connect", "connected_hosts", "emulated_nat", "emulated_wan",
        "free_port", "last_json", "local_mesh", "local_peers", "nat_unavailable", "new_host", "node_processes",
        "parse_rate", "proven_chain", "proven_record", "publish_digits_task", "rules_task", "run_cli", "run_forked",
        "run_node_processes", "run_script", "script_members", "slow_layers", "start_forked", "start_script",
        "subscribed", "task_status_of", "text_corpus", "votes_for", "wait_for", "wait_until", "wan_node_processes",
        "wan_unavailable",
    ],
    "p2ptrain.training": [
        "Average", "DeviceError", "GradientBridge", "LocalSGDTrainer", "MAX_MANIFEST_BYTES", "MOMENTUM_KEY",
        "ManifestError", "OuterOptimizer", "PlanAverager",
        "PositionedBatches",
        "PretrainedError", "RoundTimings", "StageFile", "StateSnapshot", "StepResult", "StepSkipped", "Trainer",
        "TrainerError", "UserLocalSGDTrainer", "UserTrainer",
        "batched", "batches_forever", "check_stage_signatures", "config_snippet",
        "describe_model_file", "evaluate_batches", "export_pretrained",
        "import_pretrained", "inner_lr", "is_manifest", "load_model", "loss_and_hits", "lr_at", "manifest_bytes",
        "model_file", "model_from_bytes", "module_device", "new_trainer", "read_manifest", "resolve_device",
        "round_spec", "run_round", "slow_on_sparse",
        "stage_file_cids", "stage_signatures_problem", "step_inner", "warm_up_torch", "zero_unless_finite",
    ],
    "p2ptrain.wire": [
        "Attestation", "Capabilities", "ConfirmedRecord", "CoordinatorBeat", "DIGEST_BYTES", "DRAW_BYTES", "DTYPES",
        "DecodeError", "ENTRY_BYTES", "FrameError", "Goodbye", "HEADER", "HeadRequest", "Header", "Heartbeat", "Kind",
        "MAX_ACCUSED", "MAX_BUILDERS", "MAX_BUILDER_NAME_LEN", "MAX_FIRST_FRAME",
        "MAX_MESSAGE_BYTES", "MAX_STATEMENT_BYTES", "MAX_SUMMARY_ENTRY_BYTES", "MAX_TIMED_ENTRY_BYTES", "MESH_TOPIC",
        "MESSAGES",
        "MessageRegistry", "ModelRecord", "ModelServed", "NORM_BYTES",
        "PROTOCOL",
        "Phase", "ReplayGuard", "RoundFailed", "RoundPlan", "SIGNATURE_BYTES", "Said", "SchemaError", "Signed",
        "SignedAttestation", "SignedModelRecord", "SignedStageStatement", "SignedVote", "StageStatement",
        "StatementError", "SummaryEntry", "TASKS_TOPIC", "TaskAnnounce", "TaskCancel",
        "TaskHead", "TaskResume", "Vote", "VoteRequest", "abort_frame", "busy_frame", "decode", "encode",
        "from_plain", "hello_frame", "is_busy", "message", "norms_bytes", "parse_abort", "parse_draw", "parse_header",
        "parse_norms", "peek_type", "read_statement", "read_summary_entry", "ready_frame", "round_digest", "statement",
        "statement_bytes", "summary_entry_bytes", "task_topic", "to_plain",
    ],
}


def test_every_package_is_listed() -> None:
    packages = sorted("p2ptrain" + "".join("." + part for part in p.parent.relative_to(ROOT / "p2ptrain").parts)
                      for p in (ROOT / "p2ptrain").rglob("__init__.py") if p.parent.name != "cli")
    assert packages == sorted(EXPORTS)


@pytest.mark.parametrize("package", sorted(EXPORTS))
def test_each_package_exports_exactly_its_public_names(package: str) -> None:
    module = importlib.import_module(package)
    assert sorted(module.__all__) == EXPORTS[package]


@pytest.mark.parametrize("package", sorted(EXPORTS))
def test_every_exported_name_resolves_and_is_listed_by_dir(package: str) -> None:
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if getattr(module, name, None) is None]
    assert missing == []
    assert set(module.__all__) <= set(dir(module))


def test_an_unknown_name_is_an_attribute_error() -> None:
    import p2ptrain.protocol

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        p2ptrain.protocol.Nope  # noqa: B018


def test_a_name_is_imported_from_its_module_only_when_asked_for() -> None:
    # `p2ptrain --help` stays light: p2ptrain.ipfs exports the Bitswap exchange (libp2p) beside the
    # CID parser; asking for the parser alone must not import the exchange, nor torch.
    code = ("import sys; from p2ptrain.ipfs import parse_cid; from p2ptrain.control import TaskStatus; "
            "print(sorted(m for m in ('libp2p', 'torch', 'trio', 'p2ptrain.ipfs._exchange') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
