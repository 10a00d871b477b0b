"""Task spec: strict validation whose errors name the field, canonical bytes, requirements."""

import json
import re
from pathlib import Path

import pytest

from p2ptrain.task import (TaskError, load_task, member_device, task_bytes, task_from_bytes, total_steps,
                           unmet_requirement)
from p2ptrain.task._spec import meets_requirements
from p2ptrain.wire import Capabilities

CID = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
EXAMPLE = Path(__file__).resolve().parents[2] / "node" / "tasks" / "digits-mlp.toml"

BASE = f"""
name = "t"
[model]
name = "mlp"
[dataset]
manifest = "{CID}"
[optimizer]
name = "sgd"
lr = 0.1
[training]
batch_size = 16
total_steps = 10
"""


def with_(section: str, line: str) -> str:
    """BASE with ``line`` added to ``[section]`` (or at top level for section "")."""
    if not section:
        return line + "\n" + BASE
    if f"[{section}]" in BASE:
        return BASE.replace(f"[{section}]\n", f"[{section}]\n{line}\n")
    return BASE + f"\n[{section}]\n{line}\n"


def test_minimal_task_gets_defaults():
    task = load_task(BASE)
    assert task.optimizer.momentum == 0.0 and task.optimizer.beta1 is None
    assert task.training.sync_interval == 1 and task.training.checkpoint_interval == 10
    assert task.compression.density == 0.01 and task.compression.error_feedback
    assert task.requirements.device == "cpu"


@pytest.mark.parametrize(
    "section, line, field",
    [
        ("optimizer", "momentum = -1", "optimizer.momentum"),
        ("", "typo = 1", "typo"),
        ("model", 'kwargs = { hidden = [0] }', "model.kwargs.hidden[0]"),
        ("model", 'kwargs = { depth = 2 }', "model.kwargs.depth"),
        ("model", 'kwargs = { hidden = [[1]] }', "model.kwargs.hidden[0]"),
        ("training", "sync_interval = 0", "training.sync_interval"),
        ("training", 'epochs = 2', "training.total_steps"),
        ("compression", "density = 0", "compression.density"),
        ("compression", 'error_feedback = "yes"', "compression.error_feedback"),
        ("peers", "min = 4\nmax = 2", "peers.max"),
        ("peers", "max = 100000", "peers.max"),
        ("requirements", 'device = "tpu"', "requirements.device"),
        ("schedule", 'name = "cosine"\nwarmup_steps = 50', "schedule.warmup_steps"),
        ("schedule", "warmup_steps = 5", "schedule.warmup_steps"),
        ("", 'initial_model = "not-a-cid"', "initial_model"),
        ("", "seed = -1", "seed"),
        ("optimizer", "beta1 = 0.5", "optimizer.beta1"),
        ("dataset", "extra = 1", "dataset.extra"),
    ],
)
def test_errors_name_the_field(section, line, field):
    with pytest.raises(TaskError) as info:
        load_task(with_(section, line))
    assert str(info.value).startswith(field + ":"), str(info.value)


def test_bad_values_of_required_fields():
    for old, new, field in [
        ("lr = 0.1", "lr = 0", "optimizer.lr"),
        ("lr = 0.1", "lr = nan", "optimizer.lr"),
        ('name = "sgd"', 'name = "lamb"', "optimizer.name"),
        ('name = "mlp"', 'name = "resnet1000"', "model.name"),
        (f'manifest = "{CID}"', 'manifest = "x"', "dataset.manifest"),
        ("batch_size = 16", "batch_size = 0", "training.batch_size"),
        ("batch_size = 16\n", "", "training.batch_size"),
    ]:
        with pytest.raises(TaskError, match="^" + re.escape(field) + ":"):
            load_task(BASE.replace(old, new, 1))
    with pytest.raises(TaskError, match="^task: not valid TOML"):
        load_task("name = ")
    with pytest.raises(TaskError, match="^model: missing"):
        load_task(BASE.replace('[model]\nname = "mlp"\n', ""))


def test_oversized_model_refused_before_allocation():
    huge = with_("model", 'kwargs = { in_features = 1000000, hidden = [60000], out_features = 10 }')
    with pytest.raises(TaskError, match=r"^model.kwargs: mlp would have [\d,]+ parameters, over"):
        load_task(huge)


def test_canonical_bytes_stable_and_defaults_filled():
    a = load_task(BASE)
    # The same task written differently: explicit defaults, other key order, int for a float.
    b = load_task(
        BASE.replace("lr = 0.1", "weight_decay = 0\nlr = 0.1\nmomentum = 0.0")
        + '\n[compression]\nfp16_values = false\ndensity = 0.01\n[schedule]\nname = "constant"\n'
    )
    assert task_bytes(a) == task_bytes(b)
    assert task_from_bytes(task_bytes(a)) == a
    assert task_bytes(load_task(BASE.replace("lr = 0.1", "lr = 0.2"))) != task_bytes(a)


def test_task_bytes_must_be_canonical_and_valid():
    data = task_bytes(load_task(BASE))
    with pytest.raises(TaskError, match="canonical"):
        task_from_bytes(data.replace(b'{"compression"', b'{ "compression"'))
    with pytest.raises(TaskError, match="^optimizer.lr"):
        task_from_bytes(data.replace(b'"lr":0.1', b'"lr":-1.0'))
    with pytest.raises(TaskError, match="not JSON"):
        task_from_bytes(b"\x00garbage")


def test_example_task_file_is_valid_once_given_a_manifest():
    text = EXAMPLE.read_text()
    with pytest.raises(TaskError, match="^dataset.manifest"):
        load_task(text)  # the placeholder must be replaced by a real manifest CID
    task = load_task(re.sub(r'manifest = "\w+"', f'manifest = "{CID}"', text))
    assert task.name == "digits-mlp" and task.model.name == "mlp"


def caps(device="cpu", ram_mb=1024, gpu_mb=None):
    return Capabilities(
        device=device, cpu_count=2, free_ram_bytes=ram_mb << 20, version="0.1.0",
        gpu_name="gpu" if gpu_mb else None, gpu_memory_bytes=(gpu_mb << 20) if gpu_mb else None,
    )


def test_requirements():
    cpu_task = load_task(with_("requirements", "min_memory_mb = 512"))
    assert meets_requirements(cpu_task, caps(ram_mb=1024))
    assert not meets_requirements(cpu_task, caps(ram_mb=256))
    assert "512 MiB of free RAM" in unmet_requirement(cpu_task, caps(ram_mb=256))
    assert meets_requirements(cpu_task, caps("cuda", ram_mb=1024, gpu_mb=8))  # runs on its CPU
    cuda_task = load_task(with_("requirements", 'device = "cuda"\nmin_memory_mb = 4096'))
    assert not meets_requirements(cuda_task, caps(ram_mb=10**6))
    assert not meets_requirements(cuda_task, caps("cuda", gpu_mb=2048))
    assert meets_requirements(cuda_task, caps("cuda", gpu_mb=8192))


def test_the_task_not_the_node_picks_a_cpu_task_s_device():
    """A ``cpu`` task (the default) trains on the CPU on a node whose --device would pick its GPU:
    its members attest each other's bits, and a GPU rounds the optimizer step otherwise. Before,
    the node's --device won and a GPU peer trained a cpu task on CUDA."""
    cpu_task, any_task = load_task(with_("training", "")), load_task(with_("requirements", 'device = "any"'))
    cuda_task = load_task(with_("requirements", 'device = "cuda"'))
    assert [member_device(cpu_task, d) for d in ("auto", "cpu", "cuda", "cuda:1")] == ["cpu"] * 4
    assert [member_device(cuda_task, d) for d in ("auto", "cuda", "cuda:1", "cpu")] == ["cuda", "cuda", "cuda:1", "cpu"]
    assert [member_device(any_task, d) for d in ("auto", "cpu", "cuda:1")] == ["auto", "cpu", "cuda:1"]


def test_epochs_become_steps():
    task = load_task(with_("training", "sync_interval = 2").replace("total_steps = 10", "epochs = 3"))
    # 3 epochs of 1000 samples over 4 peers taking 16 x 2 samples each per round.
    assert total_steps(task, 1000, 4) == 24
    assert total_steps(load_task(BASE), 1000, 4) == 10


def test_huge_integers_are_task_errors_in_toml_and_in_bytes_by_cid():
    with pytest.raises(TaskError, match="^optimizer.lr: must be a finite number"):
        load_task(BASE.replace("lr = 0.1", "lr = 1" + "0" * 400))  # was OverflowError
    with pytest.raises(TaskError, match="^optimizer.lr: must be a finite number"):
        load_task(BASE.replace("lr = 0.1", f"lr = {2**53 + 1}"))
    data = task_bytes(load_task(BASE))
    with pytest.raises(TaskError, match="integer"):
        task_from_bytes(data.replace(b'"lr":0.1', b'"lr":1' + b"0" * 400))  # was OverflowError
    with pytest.raises(TaskError, match="must be a finite number"):
        load_task(with_("model.kwargs", "in_features = 1" + "0" * 400))


def test_deep_nesting_is_a_task_error_in_toml_and_in_bytes_by_cid():
    with pytest.raises(TaskError, match="nested too deeply"):
        load_task(with_("model.kwargs", "hidden = " + "[" * 5000 + "]" * 5000))  # was RecursionError
    with pytest.raises(TaskError, match="nested"):
        task_from_bytes(b"[" * 60_000)
    with pytest.raises(TaskError, match="over the 65536 B limit"):
        load_task(BASE + "#" * 70_000)


def test_an_integer_too_long_for_python_to_read_is_a_task_error():
    with pytest.raises(TaskError, match="not valid TOML"):
        load_task(BASE.replace("lr = 0.1", "lr = " + "1" * 5000))  # was ValueError from int()


def test_overlap_checkpoints_is_opt_in_and_leaves_other_tasks_bytes_unchanged():
    plain = load_task(BASE)
    assert plain.training.overlap_checkpoints is None and b"overlap" not in task_bytes(plain)
    assert task_bytes(load_task(with_("training", "overlap_checkpoints = false"))) == task_bytes(plain)
    on = load_task(with_("training", "overlap_checkpoints = true"))
    assert on.training.overlap_checkpoints is True and b'"overlap_checkpoints":true' in task_bytes(on)
    assert task_from_bytes(task_bytes(on)) == on
    with pytest.raises(TaskError, match="^training.overlap_checkpoints: must be true or false"):
        load_task(with_("training", 'overlap_checkpoints = "yes"'))


def test_check_fraction_is_opt_in_under_clip_and_leaves_other_tasks_bytes_unchanged():
    clip = load_task(with_("compression", 'robust = "clip"'))
    assert clip.compression.check_fraction is None and b"check_fraction" not in task_bytes(clip)
    assert task_bytes(load_task(with_("compression", 'robust = "clip"\ncheck_fraction = 1.0'))) == task_bytes(clip)
    sampled = load_task(with_("compression", 'robust = "clip"\ncheck_fraction = 0.25'))
    assert sampled.compression.check_fraction == 0.25 and b'"check_fraction":0.25' in task_bytes(sampled)
    assert task_from_bytes(task_bytes(sampled)) == sampled
    for lines in ("check_fraction = 0.5", 'robust = "clip"\ncheck_fraction = 0', 'robust = "clip"\ncheck_fraction = 2',
                  'robust = "clip"\nvalues = "int8"\ncheck_fraction = 0.5'):
        with pytest.raises(TaskError, match="^compression.check_fraction"):
            load_task(with_("compression", lines))


@pytest.mark.parametrize("hostile", ["t\n2026-11-26 WARNING forged", "t\x1b[2J", "t\r", "t\x00"])
def test_text_fields_must_be_printable_in_toml_and_in_bytes_by_cid(hostile: str):
    """A task's strings are shown as they are (``task list``, ``task status``, log lines): a task
    fetched by CID whose name held a newline or a terminal escape forged a line or rewrote the
    terminal of whoever listed it. Printable text only, in the TOML and in the bytes by CID."""
    with pytest.raises(TaskError, match="^name: has characters that are not printable"):
        load_task(BASE.replace('name = "t"', f"name = {json.dumps(hostile)}"))
    data = task_bytes(load_task(BASE))
    with pytest.raises(TaskError, match="^name: has characters that are not printable"):
        task_from_bytes(data.replace(b'"name":"t"', b'"name":' + json.dumps(hostile).encode()))
