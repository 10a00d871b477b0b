"""The ``[pipeline]`` section of a task: checked when the task is parsed (the cut on the meta device,
the members, the microbatches), one TaskError naming the field, canonical bytes with every default
filled in; a task without it keeps its bytes (tests/wire/test_canonical.py pins them)."""

from __future__ import annotations

import pytest

from p2ptrain.models import build_model, stage_sizes
from p2ptrain.pipeline import partition
from p2ptrain.run._stage_copies import copied_stages
from p2ptrain.task import TaskError, load_task, task_bytes, task_from_bytes, unmet_requirement
from p2ptrain.wire import Capabilities

from .conftest import CID, LM, LM_TASK as BASE


def pipelined(*lines: str, base: str = BASE) -> str:
    return base + "[pipeline]\n" + "\n".join(lines) + "\n"


def test_a_pipelined_task_gets_defaults_and_canonical_bytes():
    task = load_task(pipelined("stages = 4"))
    assert task.pipeline is not None
    assert (task.pipeline.stages, task.pipeline.microbatch_size) == (4, 8)  # one microbatch: the batch
    assert (task.pipeline.activations, task.pipeline.check_fraction) == ("fp16", 0.05)
    data = task_bytes(task)
    assert b'"pipeline":{"activations":"fp16","check_fraction":0.05,"microbatch_size":8,"stages":4}' in data
    assert task_from_bytes(data) == task
    # Written out in full, it is the same task and the same bytes (one task, one CID).
    full = pipelined("stages = 4", "microbatch_size = 8", 'activations = "fp16"', "check_fraction = 0.05")
    assert task_bytes(load_task(full)) == data
    other = load_task(pipelined("stages = 2", "microbatch_size = 2", 'activations = "int8"', "check_fraction = 0"))
    assert other.pipeline is not None and other.pipeline.microbatch_size == 2 and task_bytes(other) != data


def test_copies_of_following_stages_are_named_only_by_a_task_that_asks_for_them():
    silent = load_task(pipelined("stages = 4"))
    assert silent.pipeline is not None and silent.pipeline.copies is None and silent.pipeline.stage_copies == 1
    assert b"copies" not in task_bytes(silent)  # the bytes (and CID) of a task that is silent, as before
    three = load_task(pipelined("stages = 4", "copies = 3"))
    assert three.pipeline is not None and three.pipeline.stage_copies == 3
    assert b'"copies":3' in task_bytes(three) and task_from_bytes(task_bytes(three)) == three
    # Each member keeps the files of the k stages after its own, cyclically: every stage's files on k + 1 stages.
    assert [copied_stages(s, 4, 1) for s in range(4)] == [[1], [2], [3], [0]]
    assert [copied_stages(s, 4, 3) for s in range(4)] == [[1, 2, 3], [2, 3, 0], [3, 0, 1], [0, 1, 2]]
    for k in (1, 2, 3):
        holders = [sum(t in copied_stages(s, 4, k) or t == s for s in range(4)) for t in range(4)]
        assert holders == [k + 1] * 4


def test_a_sparse_stage_sum_is_named_only_by_a_task_that_asks_for_it():
    """``stage_sum``: "dense" (the default) is stored as no field, so a task that is silent on it, or
    names the default, keeps the bytes and CID it had before the option existed; "sparse" is stored."""
    silent = load_task(pipelined("stages = 4"))
    assert silent.pipeline is not None and silent.pipeline.stage_sum is None and not silent.pipeline.sparse_sum
    assert b"stage_sum" not in task_bytes(silent)
    assert task_bytes(load_task(pipelined("stages = 4", 'stage_sum = "dense"'))) == task_bytes(silent)
    sparse = load_task(pipelined("stages = 4", 'stage_sum = "sparse"'))
    assert sparse.pipeline is not None and sparse.pipeline.sparse_sum
    assert b'"stage_sum":"sparse"' in task_bytes(sparse) and task_from_bytes(task_bytes(sparse)) == sparse
    # Bytes by CID that spell the default out are not canonical: one task, one CID.
    spelled = task_bytes(silent).replace(b'"stages":4', b'"stage_sum":"dense","stages":4')
    with pytest.raises(TaskError, match="canonical"):
        task_from_bytes(spelled)


def test_balance_by_measured_times_is_named_only_by_a_task_that_asks_for_it():
    """``balance``: "parameters" (the default) is stored as no field, so a task silent on it, or that
    names the default, keeps the bytes and CID it had before the option existed; "measured" is stored."""
    silent = load_task(pipelined("stages = 4"))
    assert silent.pipeline is not None and silent.pipeline.balance is None and not silent.pipeline.measured_balance
    assert b"balance" not in task_bytes(silent)
    assert task_bytes(load_task(pipelined("stages = 4", 'balance = "parameters"'))) == task_bytes(silent)
    measured = load_task(pipelined("stages = 4", 'balance = "measured"'))
    assert measured.pipeline is not None and measured.pipeline.measured_balance
    assert b'"balance":"measured"' in task_bytes(measured) and task_from_bytes(task_bytes(measured)) == measured
    spelled = task_bytes(silent).replace(b'"activations":"fp16",', b'"activations":"fp16","balance":"parameters",')
    assert spelled != task_bytes(silent)
    with pytest.raises(TaskError, match="canonical"):
        task_from_bytes(spelled)


def test_a_pipelined_task_may_train_in_local_sgd_mode_without_second_opinions():
    """Local-SGD mode: a stage's replicas hold the same weights only at outer steps, so a second
    opinion (bit for bit) cannot be asked between them; the default share is 0 there (stored, like
    every pipelined task's; a sync task's default stays 0.05, its bytes unchanged), and a share above 0
    is refused (the test of the table above). On main every such task was refused."""
    task = load_task(pipelined("stages = 2", base=LOCAL_SGD))
    assert task.pipeline is not None and task.pipeline.check_fraction == 0.0 and task.training.local_sgd
    data = task_bytes(task)
    assert b'"check_fraction":0.0' in data and task_from_bytes(data) == task
    assert task_bytes(load_task(pipelined("stages = 2", "check_fraction = 0", base=LOCAL_SGD))) == data
    sparse = load_task(pipelined("stages = 2", 'stage_sum = "sparse"', base=LOCAL_SGD) + "[outer]\noptimizer = \"nesterov\"\n")
    assert sparse.pipeline is not None and sparse.pipeline.sparse_sum and sparse.outer is not None
    sync = load_task(pipelined("stages = 2"))
    assert sync.pipeline is not None and sync.pipeline.check_fraction == 0.05


def test_a_task_without_the_section_has_no_pipeline_in_its_bytes():
    plain = load_task(BASE)
    assert plain.pipeline is None and b"pipeline" not in task_bytes(plain)
    assert task_from_bytes(task_bytes(plain)) == plain
    # Bytes by CID that leave a default out are not canonical: refused as every such task is.
    short = task_bytes(load_task(pipelined("stages = 4"))).replace(b'"check_fraction":0.05,', b"")
    with pytest.raises(TaskError, match="canonical"):
        task_from_bytes(short)


LOCAL_SGD = BASE.replace("total_steps = 10", 'total_steps = 10\nmode = "local_sgd"\ninner_steps = 4')
CNN = BASE.replace('name = "transformer_lm"\nkwargs = { vocab_size = 61, context = 16, width = 16, depth = 2, heads = 2 }',
                   'name = "cnn"')
USER = BASE.replace('name = "transformer_lm"\nkwargs = { vocab_size = 61, context = 16, width = 16, depth = 2, heads = 2 }',
                    f'name = "user"\narchitecture = "{CID}"').replace('[optimizer]\nname = "sgd"\nlr = 0.1\n', "")


@pytest.mark.parametrize(
    "text, error",
    [
        (pipelined("microbatch_size = 2"), "pipeline.stages: missing"),
        (pipelined("stages = 1"), "pipeline.stages: must be between 2 and 64"),
        (pipelined("stages = 65"), "pipeline.stages: must be between 2 and 64"),
        (pipelined("stages = 2", "typo = 1"), "pipeline.typo: unknown field"),
        (pipelined("stages = 2", 'activations = "2bit"'), "pipeline.activations: must be one of fp32, fp16, int8"),
        (pipelined("stages = 2", "check_fraction = 1.5"), "pipeline.check_fraction: must be between 0 and 1"),
        (pipelined("stages = 2", "microbatch_size = 0"), "pipeline.microbatch_size: must be between"),
        (pipelined("stages = 3", "copies = 3"), "pipeline.copies: must be between 1 and 2"),
        (pipelined("stages = 3", "copies = 0"), "pipeline.copies: must be between 1 and 2"),
        (pipelined("stages = 2", "microbatch_size = 3"), "pipeline.microbatch_size: 3 does not divide training.batch_size (8)"),
        (pipelined("stages = 2", "microbatch_size = 16"), "pipeline.microbatch_size: 16 does not divide"),
        (pipelined("stages = 5"), "pipeline.stages: 5 stages need peers.min >= 5"),
        # 8 members, but a transformer_lm of depth 2 has 4 pieces: embedding, two blocks, head.
        (pipelined("stages = 5", base=BASE.replace("min = 4", "min = 8")), "pipeline.stages: cannot cut 4 pieces into 5 stages"),
        (pipelined("stages = 2", base=CNN), "pipeline.stages: a SmallCNN cannot be cut into stages"),
        (pipelined("stages = 2", base=USER), "pipeline: not for a run of the members' own model"),
        (pipelined("stages = 2", "check_fraction = 0.05", base=LOCAL_SGD),
         'pipeline.check_fraction: 0 with training.mode = "local_sgd" (a second opinion compares two replicas\' '
         "answers bit for bit"),
        ("pipeline = 4\n" + BASE, "pipeline: must be a table"),
        (pipelined("stages = 2", 'stage_sum = "topk"'), "pipeline.stage_sum: must be one of dense, sparse (got 'topk')"),
        (pipelined("stages = 2", "stage_sum = 1"), "pipeline.stage_sum: "),
        (pipelined("stages = 2", 'balance = "time"'),
         "pipeline.balance: must be one of parameters, measured, recut (got 'time')"),
        (pipelined("stages = 2", 'stage_sum = "sparse"') + "[compression]\nerror_feedback = false\n",
         'pipeline.stage_sum: "sparse" needs compression.error_feedback = true and compression.density < 1'),
        (pipelined("stages = 2", 'stage_sum = "sparse"') + "[compression]\ndensity = 1.0\n",
         'pipeline.stage_sum: "sparse" needs compression.error_feedback'),
    ],
)
def test_a_bad_pipeline_is_one_error_naming_the_field(text, error):
    with pytest.raises(TaskError) as info:
        load_task(text)
    assert str(info.value).startswith(error), str(info.value)


def test_an_mlp_is_a_sequence_and_can_be_cut():
    mlp = BASE.replace('name = "transformer_lm"\nkwargs = { vocab_size = 61, context = 16, width = 16, depth = 2, heads = 2 }',
                       'name = "mlp"\nkwargs = { hidden = [32, 16] }')
    assert load_task(pipelined("stages = 4", base=mlp)).pipeline is not None


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_the_parse_and_the_partition_cut_the_same_way(stages):
    """models.stage_sizes (meta device, what the parse checks and the plans weigh) and
    pipeline.partition (the real model's stages) agree stage by stage."""
    stages_built = partition(build_model("transformer_lm", LM, seed=1), stages)
    assert stage_sizes("transformer_lm", LM, stages) == [s.parameter_count() for s in stages_built]


def test_a_node_joins_a_pipelined_task_on_the_cpu():
    """A pipelined task is run (run/_stages.py), on the CPU: one that requires CUDA is refused in one
    line, since the stages would not train there."""
    caps = Capabilities(device="cuda", cpu_count=2, free_ram_bytes=1 << 30, version="0.1.0")
    assert unmet_requirement(load_task(pipelined("stages = 4")), caps) is None
    cuda = load_task(pipelined("stages = 4") + '[requirements]\ndevice = "cuda"\n')
    why = unmet_requirement(cuda, caps)
    assert why == "it is cut into 4 pipeline stages, which this version trains on the CPU only"


def _lm(width: int, depth: int, stages: int) -> str:
    base = BASE.replace("width = 16, depth = 2", f"width = {width}, depth = {depth}").replace("min = 4", "min = 16")
    return pipelined(f"stages = {stages}", base=base) if stages else base


def test_a_pipelined_model_may_outgrow_one_member_but_no_stage_may():
    """A transformer_lm over the 50M parameters one process may build is a pipelined task's when
    each stage holds at most that many (a member builds its stage only); the whole stays under
    MAX_PIPELINED_PARAMETERS (every member hashes every stage's initial bits), and a model the
    registry builds whole (an mlp) keeps the 50M cap, cut or not."""
    big = load_task(_lm(1024, 12, 4))  # 151M parameters, 4 stages of at most 50M
    assert big.pipeline is not None and max(stage_sizes("transformer_lm", big.model.arguments, 4)) <= 50_000_000
    with pytest.raises(TaskError, match="over the 50,000,000 cap"):
        load_task(_lm(1024, 12, 0))  # the same model without stages: one process holds it all
    with pytest.raises(TaskError, match=r"pipeline.stages: stage \d would hold [\d,]+ parameters, over the 50,000,000"):
        load_task(_lm(1024, 12, 2))
    with pytest.raises(TaskError, match="over the 400,000,000 cap"):
        load_task(_lm(1536, 16, 16))  # 453M: too much for every member to initialise and hash
    mlp = BASE.replace('name = "transformer_lm"\nkwargs = { vocab_size = 61, context = 16, width = 16, depth = 2, heads = 2 }',
                       'name = "mlp"\nkwargs = { in_features = 8192, hidden = [4096, 4096, 4096, 4096] }')
    with pytest.raises(TaskError, match="over the 50,000,000 cap"):
        load_task(pipelined("stages = 4", base=mlp))
