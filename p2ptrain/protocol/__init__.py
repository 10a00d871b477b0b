"""The coordination protocol: pure, clock-injected state machines that a simulator can drive.

The election of a coordinator (terms, votes, certificates; who counts as alive), the round book
(plans followed, failures, quarantine), the coordinator's planner (whether to plan now, the next
plan), what a plan is made of, signed model records and their attestations (deterministic model
bytes, the tally), the confirmed chain and its proofs, and detached signatures
(:mod:`p2ptrain.protocol.signing`, a public submodule). Nothing here touches the network or the
clock: ``run`` gathers the inputs and carries out the decisions.
Imports ``base``, ``wire``, ``data`` (a checked safetensors header) and ``task``.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.protocol import signing as signing
    from p2ptrain.protocol._arithmetics import bits_class as bits_class, Classes as Classes
    from p2ptrain.protocol._assignment import (
        assign as assign,
        AssignmentError as AssignmentError,
        throughput as throughput,
    )
    from p2ptrain.protocol._recut import (
        measured_cut as measured_cut,
        piece_costs as piece_costs,
        plan_cut as plan_cut,
        RECUT_MARGIN as RECUT_MARGIN,
    )
    from p2ptrain.protocol._stage_costs import (
        measured_costs as measured_costs,
        median_micros as median_micros,
        StageTimes as StageTimes,
    )
    from p2ptrain.protocol._attestations import (
        ATTEST_TIMEOUT_S as ATTEST_TIMEOUT_S,
        Attestations as Attestations,
        ForkAnswers as ForkAnswers,
    )
    from p2ptrain.protocol._candidacy import won_alone as won_alone
    from p2ptrain.protocol._class_claims import ClassClaims as ClassClaims, term_candidate as term_candidate
    from p2ptrain.protocol._election import (
        Election as Election,
        ElectionConfig as ElectionConfig,
        ElectionMessage as ElectionMessage,
        View as View,
    )
    from p2ptrain.protocol._lineage import (
        audit as audit,
        Chain as Chain,
        chain_lines as chain_lines,
        ChainRules as ChainRules,
        election_problem as election_problem,
        entry_from_bytes as entry_from_bytes,
        MAX_CHAIN_BYTES as MAX_CHAIN_BYTES,
        parse_entry as parse_entry,
        read_chain as read_chain,
    )
    from p2ptrain.protocol._held_plans import HeldPlans as HeldPlans
    from p2ptrain.protocol._participation import Participation as Participation, receive_noting as receive_noting
    from p2ptrain.protocol._planner import Hold as Hold
    from p2ptrain.protocol._quarantine import Convictions as Convictions
    from p2ptrain.protocol._plans import (
        buffers_round_id as buffers_round_id,
        inner_round_id as inner_round_id,
        is_checkpoint as is_checkpoint,
        orphaned_stages as orphaned_stages,
        owner_seed as owner_seed,
        plan_order as plan_order,
        round_id as round_id,
        round_seed as round_seed,
        shard_of as shard_of,
        stage_moves as stage_moves,
        stage_rings as stage_rings,
        stage_round_id as stage_round_id,
    )
    from p2ptrain.protocol._stage_quorum import (
        check_statement as check_statement,
        sign_statement as sign_statement,
        signed_entry_problem as signed_entry_problem,
        stage_verdicts as stage_verdicts,
        StageVerdict as StageVerdict,
    )
    from p2ptrain.protocol._records import (
        attest as attest,
        Fork as Fork,
        load_model_bytes as load_model_bytes,
        model_tensors as model_tensors,
        Misconduct as Misconduct,
        model_bytes as model_bytes,
        read_model_card as read_model_card,
        read_tensors as read_tensors,
        record_id as record_id,
        RecordError as RecordError,
        sign_record as sign_record,
        state_bytes as state_bytes,
        Status as Status,
        Tally as Tally,
        tensors_bytes as tensors_bytes,
        write_state_file as write_state_file,
    )
    from p2ptrain.protocol._round_book import RoundBook as RoundBook, RuleBreak as RuleBreak
    from p2ptrain.protocol._failure_reports import (own_round_lost as own_round_lost, record_confirmed as record_confirmed,
                                                    refuse_report as refuse_report, round_completed as round_completed,
                                                    span_confirmed as span_confirmed)
    from p2ptrain.protocol._trailing import (HeadAsking as HeadAsking, HeadOffers as HeadOffers,
                                             witnessable as witnessable, witness_problem as witness_problem,
                                             witnessed_chain_limits as witnessed_chain_limits)
    from p2ptrain.protocol._stage_verdicts import (check_key_message as check_key_message, convicted as convicted,
                                                   LoneFailures as LoneFailures)
    from p2ptrain.protocol._step_aborts import (
        CANNOT_FOLLOW as CANNOT_FOLLOW,
        NO_TRAINING_DATA as NO_TRAINING_DATA,
        OUT_OF_STEP as OUT_OF_STEP,
        StepAborts as StepAborts,
    )
    # The stage statements' bytes are declared in wire/ (wire/_stage_statements.py); kept here too,
    # where they were first exported.
    from p2ptrain.wire import (
        MAX_STATEMENT_BYTES as MAX_STATEMENT_BYTES,
        read_statement as read_statement,
        SignedStageStatement as SignedStageStatement,
        StageStatement as StageStatement,
        statement_bytes as statement_bytes,
        StatementError as StatementError,
    )
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
