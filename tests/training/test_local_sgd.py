"""Local-SGD mode (DiLoCo): the task fields, the outer optimizer, and the trainer's round on real digits."""

from __future__ import annotations

import pytest
import torch
import trio

from p2ptrain.data import IPFSDataset
from p2ptrain.training import LocalSGDTrainer, RoundTimings, Trainer, batched, batches_forever, new_trainer, run_round
from p2ptrain.training._outer import MOMENTUM_KEY, OuterOptimizer
from p2ptrain.protocol import RecordError, tensors_bytes
from p2ptrain.task import OuterSpec, TaskError, load_task, task_bytes, task_from_bytes, total_steps

BASE = """name = "t"
[model]
name = "mlp"
[dataset]
manifest = "bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy"
[optimizer]
name = "adamw"
lr = 0.001
[training]
batch_size = 8
total_steps = 10
"""


def test_sync_mode_is_the_default_and_older_tasks_keep_their_bytes() -> None:
    task = load_task(BASE)
    assert not task.training.local_sgd and task.outer is None and task.training.steps_per_round == 1
    assert b'"mode"' not in task_bytes(task) and b"outer" not in task_bytes(task) and b'"values"' not in task_bytes(task)
    assert task_bytes(load_task(BASE + 'mode = "sync"\n[compression]\nvalues = "fp32"\n')) == task_bytes(task)
    assert task_bytes(load_task(BASE + '[compression]\nvalues = "fp16"\n')) == task_bytes(
        load_task(BASE + "[compression]\nfp16_values = true\n"))


def test_local_sgd_fields_defaults_and_canonical_bytes() -> None:
    task = load_task(BASE + 'mode = "local_sgd"\ninner_steps = 50\n[compression]\nvalues = "2bit"\n')
    assert task.training.local_sgd and task.training.inner_steps == 50
    assert task.outer == OuterSpec("nesterov", 0.7, 0.9)
    assert task.compression.values == "2bit"
    assert task_from_bytes(task_bytes(task)) == task
    avg = load_task(BASE + 'mode = "local_sgd"\ninner_steps = 5\n[outer]\noptimizer = "average"\n')
    assert avg.outer == OuterSpec("average", None, None) and task_from_bytes(task_bytes(avg)) == avg
    # epochs count rounds of inner_steps local steps per member.
    epochs = load_task(BASE.replace("total_steps = 10", "epochs = 1.0") + 'mode = "local_sgd"\ninner_steps = 5\n')
    assert total_steps(epochs, 1000, 4) == 7  # ceil(1000 / (8 * 5 * 4))


@pytest.mark.parametrize("extra,message", [
    ('mode = "diloco"\n', "training.mode: must be one of sync, local_sgd"),
    ('mode = "local_sgd"\n', "training.inner_steps: missing"),
    ("inner_steps = 5\n", 'training.inner_steps: only for mode = "local_sgd"'),
    ('mode = "local_sgd"\ninner_steps = 0\n', "training.inner_steps: must be between 1 and 10000"),
    ("[outer]\nlr = 0.5\n", 'outer: only for training.mode = "local_sgd"'),
    ('mode = "local_sgd"\ninner_steps = 5\n[outer]\noptimizer = "adam"\n', "outer.optimizer: must be one of"),
    ('mode = "local_sgd"\ninner_steps = 5\n[outer]\noptimizer = "average"\nlr = 1.0\n',
     'outer.lr: not for optimizer = "average"'),
    ('mode = "local_sgd"\ninner_steps = 5\n[outer]\nmomentum = 1.0\n', "outer.momentum: must be between 0 and 0.999"),
    ('mode = "local_sgd"\ninner_steps = 5\n[outer]\nbeta = 1\n', "outer.beta: unknown field"),
    ('[compression]\nvalues = "int4"\n', "compression.values: must be one of fp32, fp16, int8, 2bit"),
    ('[compression]\nvalues = "int8"\nfp16_values = true\n', 'compression.values: "int8" contradicts fp16_values'),
    ('[compression]\nvalues = "2bit"\ndensity = 1.0\n', "compression.values: \"2bit\" quantizes sparse values"),
    ('[compression]\nvalues = "2bit"\nerror_feedback = false\n', "needs error_feedback = true"),
])
def test_bad_local_sgd_fields_are_one_line_errors_naming_the_field(extra: str, message: str) -> None:
    with pytest.raises(TaskError) as info:
        load_task(BASE + extra)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_nesterov_outer_step_is_torchs_sgd_with_nesterov_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(1000, generator=g)
    param = torch.nn.Parameter(theta.clone())
    reference = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True, foreach=False)
    outer = OuterOptimizer(OuterSpec(), 1000)
    for _ in range(3):
        delta = torch.randn(1000, generator=g)
        outer.step(theta, delta)
        param.grad = delta.clone()
        reference.step()
        assert theta.equal(param.detach())
    assert outer.state()[MOMENTUM_KEY].equal(reference.state[param]["momentum_buffer"])


def test_average_outer_step_lands_on_the_members_mean_model() -> None:
    start = torch.randn(100)
    ends = [start + torch.randn(100) for _ in range(4)]
    delta = torch.stack([start - e for e in ends]).mean(0)
    theta = start.clone()
    OuterOptimizer(OuterSpec("average", None, None), 100).step(theta, delta)
    assert torch.allclose(theta, torch.stack(ends).mean(0), atol=1e-6)


# -- the trainer: four members with an exact mean, on real digits -----------------------------------

H, ROUNDS, WORLD = 10, 12, 4


class _Mean:
    """The members' exact mean, computed once per round id (conftest's ExactMean, for a module-scoped fixture)."""

    def __init__(self, members: int) -> None:
        self.members = members
        self.rounds: dict[int, tuple[list[torch.Tensor], trio.Event, list[torch.Tensor]]] = {}

    async def average(self, flat: torch.Tensor, round_id: int) -> torch.Tensor:
        parts, done, result = self.rounds.setdefault(round_id, ([], trio.Event(), []))
        parts.append(flat.clone())
        if len(parts) == self.members:
            result.append(torch.stack(parts).mean(0))
            done.set()
        with trio.fail_after(10):
            await done.wait()
        return result[0].clone()


@pytest.fixture(scope="module")
def trained(digits):
    """Four LocalSGDTrainers after ROUNDS rounds of H inner steps (Adam inside, Nesterov outside)."""
    store, cid = digits
    task = load_task(f"""name = "digits"\nseed = 3\n[model]\nname = "mlp"\nkwargs = {{ hidden = [64] }}
[dataset]\nmanifest = "{cid}"\n[optimizer]\nname = "adam"\nlr = 0.003
[training]\nbatch_size = 32\ntotal_steps = {ROUNDS}\nmode = "local_sgd"\ninner_steps = {H}\n""")
    trainers = [new_trainer(task, device="cpu") for _ in range(WORLD)]
    data = [batches_forever(IPFSDataset(cid, "train", rank=r, world_size=WORLD, store=store, seed=r), 32)
            for r in range(WORLD)]
    mean = _Mean(WORLD)
    history: list[set[bytes]] = []

    async def main() -> None:
        for _ in range(ROUNDS):
            async with trio.open_nursery() as nursery:
                for i in range(WORLD):
                    nursery.start_soon(run_round, trainers[i], data[i], mean.average, trainers[i].step, RoundTimings())
            history.append({t.model_bytes() for t in trainers})

    trio.run(main)
    return store, cid, task, trainers, data, history


def test_every_member_holds_the_same_bits_after_every_outer_step_and_learns_digits(trained) -> None:
    store, cid, task, trainers, _data, history = trained
    assert all(isinstance(t, LocalSGDTrainer) for t in trainers)
    assert all(len(models) == 1 for models in history)  # identical after every round
    assert len({t.optimizer_bytes() for t in trainers}) == 1
    assert all(t.step == ROUNDS for t in trainers)  # a step is an outer step
    # The inner optimizers' states are each member's own (different data), and never checkpointed.
    assert not torch.equal(trainers[0].optimizer.state_dict()["state"][0]["exp_avg"],
                           trainers[1].optimizer.state_dict()["state"][0]["exp_avg"])
    metrics = trainers[0].evaluate(batched(IPFSDataset(cid, "test", store=store, shuffle=False), 256))
    assert metrics.accuracy >= 0.90, metrics


def test_a_joiner_resumes_from_the_checkpoint_bytes_and_steps_identically(trained) -> None:
    _store, _cid, task, trainers, data, _ = trained
    a = trainers[0]
    late = new_trainer(task, device="cpu")
    assert set(a.optimizer_tensors()) == {"trainer.step", MOMENTUM_KEY}
    late.load_state(a.model_bytes(), a.optimizer_bytes())
    assert late.step == a.step and late.model_bytes() == a.model_bytes() and late.optimizer_bytes() == a.optimizer_bytes()
    # The same averaged pseudo-gradient from the same outer state: the same bits (and back again).
    delta = a.compute_gradient(data[0]).clone()
    late.compute_gradient(data[1])
    a.apply(delta.clone())
    late.apply(delta.clone())
    assert late.model_bytes() == a.model_bytes() and late.optimizer_bytes() == a.optimizer_bytes()
    a.align(a.step - 1)  # a retried round: one outer step rolled back
    assert a.step == ROUNDS and a.model_bytes() != late.model_bytes()
    # An optimizer file of the other mode, or a sync trainer's, is refused with a RecordError.
    sync = Trainer(load_task(BASE), device="cpu")
    with pytest.raises(RecordError):
        late.load_state(a.model_bytes(), tensors_bytes({"trainer.step": torch.tensor(3), "state.0.exp_avg": torch.zeros(1)}))
    assert sync.step == 0


# -- the language task: Python's own sources as bytes, and a >= 5M-parameter transformer_lm ------------


def test_the_stdlib_text_source_and_the_example_language_task(monkeypatch, tmp_path) -> None:
    import re
    from pathlib import Path

    import p2ptrain.data._builtin as builtin
    from p2ptrain.data import build_dataset
    from p2ptrain.ipfs import EmbeddedStore
    from p2ptrain.models import build_model

    monkeypatch.setattr(builtin, "TEXT_MAX_BYTES", 64 * 1024)  # the first 64 KiB: enough to check the shape
    name, features, labels = builtin.load_source("text:python-stdlib")
    window = builtin.TEXT_CONTEXT
    assert name == "text-python-stdlib" and features.dtype == labels.dtype == "uint8"
    assert features.shape == labels.shape == (64 * 1024 // (window + 1), window)
    assert (features[:, 1:] == labels[:, :-1]).all()  # a label is the next byte
    assert b"import" in features.tobytes()
    with pytest.raises(Exception, match="text:python-stdlib"):
        builtin.load_source("text:nothing")

    example = Path(__file__).resolve().parents[2] / "node" / "tasks" / "stdlib-lm.toml"
    store = EmbeddedStore(tmp_path)
    manifest, _ = build_dataset(store, name, features, labels, 2)
    task = load_task(re.sub(r'manifest = "\w+"', f'manifest = "{manifest}"', example.read_text()))
    assert task.training.local_sgd and task.compression.values == "2bit"
    model = build_model(task.model.name, task.model.kwargs, task.seed)
    assert sum(p.numel() for p in model.parameters()) >= 5_000_000
    x, y = next(iter(IPFSDataset(manifest, "train", store=store)))
    logits = model(x[None, :])  # uint8 tokens straight from the shards
    assert logits.shape == (1, window, 256) and y.shape == (window,)
