"""A hostile coordinator's ``RoundPlan.cut`` (``[pipeline] balance = "recut"``, protocol/_recut.py):
whatever a validly signed plan carries in the field, the decoder refuses it with its one declared
error (``DecodeError``: ``schema``, or ``malformed`` for an integer past int64) or the plan's checks
(``rule_problem``) name why it breaks the rules, and never raise; a cut they accept is a cut of the
task's pieces into its stages, each within one member's bound, that the trainer cuts the model at
(``pipeline.partition_at``), so taking the plan (``StagedTrainer.recut``) cannot fail on it.
Unsorted, duplicate, out-of-range, bool, float, nested, 65 and 66 bounds, and the same cut for a
task that does not re-cut, among others."""

from __future__ import annotations

import json
import struct
import time
from functools import cache

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.base import peer_id_of
from p2ptrain.models import MAX_PARAMETERS, meta_model
from p2ptrain.pipeline import partition_at
from p2ptrain.protocol._plans import rule_problem
from p2ptrain.task import cut_problem, load_task, stage_parameters
from p2ptrain.wire import decode, DecodeError, RoundPlan, to_plain
from p2ptrain.wire import _codec as codec
from p2ptrain.wire._limits import WIRE_VERSION

from .test_recut import _plan, _slow_stage_1, HEAD, RECUT, TASK

KEY = create_new_key_pair(b"\x06" * 32)
TASKS = (load_task(RECUT), load_task(TASK + 'balance = "measured"\n'), load_task(TASK))
RECUTTING = TASKS[0]
PIECES = 8  # RECUTTING's model: embedding, 6 blocks, head


# What each of the 400 examples asked again of the same three tasks, built once: a model on the meta
# device is ~5 ms to build (stage_parameters without a cut builds one too): ~440 of them, ~2.4 CPU-s
# (time(1) of the file: 8.8 -> 5.7). Neither is under test here: the plan and its checks are.
@cache
def _times(task_index: int) -> tuple[int, ...]:
    return _slow_stage_1(TASKS[task_index])


@cache
def _recutting_model():  # partition_at reads the model's pieces, never changes them
    return meta_model(RECUTTING.model.name, RECUTTING.model.arguments)


def _signed(body: dict[str, object]) -> bytes:
    """A round plan of ``body``, signed as the real encoder signs: only the schema stands in the way."""
    env = {"type": "round_plan", "sender": peer_id_of(KEY).to_base58(), "seq": 1, "ts": time.time(), "body": body}
    payload = json.dumps(env, sort_keys=True, separators=(",", ":")).encode()
    head = struct.pack(">4sBI", codec.MAGIC, WIRE_VERSION, len(payload))
    return head + payload + KEY.private_key.sign(codec._DOMAIN + head + payload)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=12,
)
_cuts = st.one_of(
    st.lists(st.integers(-2, PIECES + 2), min_size=0, max_size=6),  # near the task's shape: often a true cut
    st.lists(st.integers(0, PIECES), min_size=4, max_size=4).map(sorted),
    st.lists(st.integers(1, PIECES - 1), min_size=2, max_size=2, unique=True).map(lambda b: [0, *sorted(b), PIECES]),
    st.lists(st.integers(), max_size=70),  # huge, negative, int64 edges, 65 and 66 bounds
    st.lists(st.one_of(st.integers(0, PIECES), st.booleans(), st.floats(0, PIECES)), max_size=5),
    _json,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cuts, st.sampled_from([None, (0, 3, 4, 8)]), st.booleans(), st.booleans())
def test_a_hostile_cut_is_refused_with_one_declared_error_or_is_a_cut_the_trainer_takes(cut, before_cut, timed, at_head):
    body = to_plain(_plan(None))
    assert isinstance(body, dict)
    body["cut"] = cut
    try:
        plan = decode(_signed(body)).msg
    except DecodeError as exc:
        assert exc.reason in ("schema", "malformed"), exc  # malformed: an integer past int64 in the JSON
        return
    assert isinstance(plan, RoundPlan)
    before = _plan(before_cut, step=0)
    for index, task in enumerate(TASKS):
        micros = _times(index) if timed else None
        for prior in (None, before):
            problem = rule_problem(task, 100, plan, prior, micros, head=HEAD if at_head else None,
                                   times_cut=before_cut if timed else None)
            assert problem is None or isinstance(problem, str)
            if problem is None and plan.cut is not None:
                assert task is RECUTTING and cut_problem(task, plan.cut) is None
                assert max(stage_parameters(task, plan.cut)) <= MAX_PARAMETERS
                stages = partition_at(_recutting_model(), plan.cut)
                assert [(s.first, s.last + 1) for s in stages] == list(zip(plan.cut, plan.cut[1:], strict=False))


def test_the_cut_field_is_bounded_before_any_check_reads_it():
    """65 bounds (64 stages, the most a task has) decode and are refused by the task; 66 never decode."""
    body = to_plain(_plan(None))
    assert isinstance(body, dict)
    body["cut"] = list(range(65))
    plan = decode(_signed(body)).msg
    assert "not 3 stages" in (rule_problem(RECUTTING, 100, plan, None, head=HEAD) or "")
    body["cut"] = list(range(66))
    try:
        decode(_signed(body))
    except DecodeError as exc:
        assert exc.reason == "schema" and "more than 65" in str(exc)
    else:
        raise AssertionError("a 66-bound cut decoded")
