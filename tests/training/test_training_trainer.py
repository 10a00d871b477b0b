"""The local trainer: identical steps on every member, accuracy on real digits, state as bytes."""

import math

import pytest
import torch
import trio

from p2ptrain.data import IPFSDataset
from p2ptrain.training import RoundTimings, Trainer, TrainerError, batched, batches_forever, lr_at, resolve_device, run_round
from p2ptrain.protocol import RecordError, tensors_bytes


def member_data(store, cid, rank, world, batch=32):
    return batches_forever(IPFSDataset(cid, "train", rank=rank, world_size=world, store=store, seed=rank), batch)


def test_digits_three_members_bitwise_identical_and_accurate(digits, digits_task, ExactMean):
    store, cid = digits
    task = digits_task(cid, steps=150)
    n = 3
    trainers = [Trainer(task, device="cpu") for _ in range(n)]
    data = [member_data(store, cid, r, n) for r in range(n)]
    mean = ExactMean(n)

    async def member(i):
        while not trainers[i].done:
            await run_round(trainers[i], data[i], mean.average, trainers[i].step, RoundTimings())

    async def main():
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(member, i)

    trio.run(main)
    assert mean.calls == 150 * n
    assert len({t.model_bytes() for t in trainers}) == 1
    assert len({t.optimizer_bytes() for t in trainers}) == 1
    test = IPFSDataset(cid, "test", store=store, shuffle=False)
    metrics = trainers[0].evaluate(batched(test, 256))
    assert metrics.samples == len(test) and metrics.accuracy >= 0.90, metrics
    # Different local data really was used: one member's local gradient differs from another's.
    g = [t.compute_gradient(d) for t, d in zip(trainers, data)]
    assert not torch.equal(g[0], g[1])


def test_resume_from_bytes_continues_identically(digits, digits_task):
    store, cid = digits
    task = digits_task(cid, steps=20, **{"optimizer.name": '"adamw"', "optimizer.weight_decay": "0.01"})
    a = Trainer(task, device="cpu")
    data = member_data(store, cid, 0, 1)
    for _ in range(4):
        a.apply(a.compute_gradient(data))
    late = Trainer(task, device="cpu")
    assert late.model_bytes() != a.model_bytes()
    late.apply(late.compute_gradient(data))
    assert late.can_roll_back
    late.load_state(a.model_bytes(), a.optimizer_bytes())
    assert late.step == a.step == 4 and not late.can_roll_back
    for _ in range(3):
        g = a.compute_gradient(data)
        a.apply(g)
        late.apply(g)
    assert late.model_bytes() == a.model_bytes() and late.optimizer_bytes() == a.optimizer_bytes()


def test_resume_refuses_foreign_state(digits, digits_task):
    _, cid = digits
    task = digits_task(cid)
    t = Trainer(task, device="cpu")
    sgd = Trainer(digits_task(cid, **{"optimizer.name": '"sgd"', "optimizer.momentum": "0.9", "optimizer.lr": "0.1"}),
                  device="cpu")
    sgd.apply(torch.ones(sgd.num_parameters))
    with pytest.raises(RecordError, match=r"unexpected tensor 'state.0.momentum_buffer'"):
        t.load_state(t.model_bytes(), sgd.optimizer_bytes())
    wide = Trainer(digits_task(cid, **{"model.kwargs": "{ hidden = [65] }"}), device="cpu")
    with pytest.raises(RecordError, match="architecture needs"):
        t.load_state(wide.model_bytes(), t.optimizer_bytes())


def test_non_finite_gradients_handled_identically(digits, caplog, digits_task):
    store, cid = digits
    task = digits_task(cid)
    a, b = Trainer(task, device="cpu"), Trainer(task, device="cpu")
    before = a.model_bytes()
    bad = torch.zeros(a.num_parameters)
    bad[3] = math.nan
    ra, rb = a.apply(bad), b.apply(bad.clone())
    assert not ra.applied and not rb.applied and a.step == b.step == 1
    assert a.model_bytes() == before == b.model_bytes()
    assert "not finite" in caplog.text
    # A member whose own loss explodes contributes zeros rather than poisoning the mean.
    with torch.no_grad():
        a.params[0].fill_(math.inf)
    g = a.compute_gradient(member_data(store, cid, 0, 1))
    assert torch.count_nonzero(g) == 0
    with pytest.raises(TrainerError, match="shape"):
        a.apply(torch.zeros(3))


def test_rollback_and_align(digits, digits_task):
    store, cid = digits
    task = digits_task(cid)
    t = Trainer(task, device="cpu")
    data = member_data(store, cid, 0, 1)
    t.apply(t.compute_gradient(data))
    state = (t.model_bytes(), t.optimizer_bytes())
    g = t.compute_gradient(data)
    t.apply(g)
    assert t.step == 2
    t.align(1)  # the coordinator retries round 1: this member had applied it, so it rolls back
    assert t.step == 1 and (t.model_bytes(), t.optimizer_bytes()) == state
    t.apply(g)
    # Snapshots reuse their tensors; after a rollback the optimizer's state may be those very
    # tensors, so the next snapshot must not write into them.
    state = (t.model_bytes(), t.optimizer_bytes())
    t.apply(t.compute_gradient(data))
    t.align(2)
    assert t.step == 2 and (t.model_bytes(), t.optimizer_bytes()) == state
    with pytest.raises(TrainerError, match="resync"):
        t.align(0)  # two steps behind the plan: only a checkpoint can fix that
    with pytest.raises(TrainerError, match="resync"):
        t.align(5)


def test_lr_schedules(digits, digits_task):
    _, cid = digits
    const = digits_task(cid, steps=100)
    assert lr_at(const, 0, 100) == lr_at(const, 99, 100) == 0.005
    warm = digits_task(cid, steps=100, **{"schedule.name": '"warmup"', "schedule.warmup_steps": "10"})
    assert lr_at(warm, 0, 100) == pytest.approx(0.0005) and lr_at(warm, 9, 100) == pytest.approx(0.005)
    assert lr_at(warm, 50, 100) == 0.005
    cos = digits_task(cid, steps=100, **{"schedule.name": '"cosine"', "schedule.warmup_steps": "10",
                                          "schedule.min_lr_ratio": "0.1"})
    assert lr_at(cos, 10, 100) == pytest.approx(0.005)
    assert lr_at(cos, 55, 100) == pytest.approx(0.005 * (0.1 + 0.9 * 0.5))
    assert lr_at(cos, 100, 100) == pytest.approx(0.0005)


def test_devices_and_precision(digits, digits_task):
    store, cid = digits
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(TrainerError, match="only cpu, cuda and auto"):
        resolve_device("mps")
    task = digits_task(cid)
    t = Trainer(task, device="auto", precision="bf16")
    g = t.compute_gradient(member_data(store, cid, 0, 1))
    assert g.dtype == torch.float32 and g.device.type == "cpu" and torch.isfinite(g).all()
    t.apply(g)
    if not torch.cuda.is_available():
        with pytest.raises(TrainerError, match="fp16 needs a CUDA device"):
            Trainer(task, device="cpu", precision="fp16")


def test_language_model_trains_on_tokens(digits, digits_task):
    _, cid = digits
    task = digits_task(cid, **{"model.name": '"transformer_lm"',
                               "model.kwargs": "{ vocab_size = 16, context = 8, width = 16, depth = 1, heads = 2 }",
                               "optimizer.lr": "0.01"})
    t = Trainer(task, device="cpu")
    # A deterministic sequence (i -> i+1 mod 16): next-token accuracy must rise well above chance.
    starts = torch.randint(0, 16, (64, 1), generator=torch.Generator().manual_seed(0))
    seq = (starts + torch.arange(9)) % 16

    def batches():
        while True:
            yield seq[:, :8], seq[:, 1:]

    it = batches()
    for _ in range(60):
        t.apply(t.compute_gradient(it))
    assert t.evaluate([(seq[:, :8], seq[:, 1:])]).accuracy > 0.9


def test_apply_leaves_the_average_alone(digits, digits_task):
    """The optimizer reads the average through views (no copy per step): it must not write into it,
    nor keep it once the step is taken (the caller reuses that buffer next round)."""
    _store, cid = digits
    task = digits_task(cid)
    a, b = Trainer(task, device="cpu"), Trainer(task, device="cpu")
    assert all(g.get("fused") for g in a.optimizer.param_groups)
    average = torch.randn(a.num_parameters, generator=torch.Generator().manual_seed(1))
    kept = average.clone()
    a.apply(average)
    b.apply(kept.clone())
    assert torch.equal(average, kept)
    assert all(p.grad is None for p in a.params)
    assert a.model_bytes() == b.model_bytes()


def test_an_optimizer_file_with_non_ascii_digits_is_a_record_error(digits, digits_task):
    """'²'.isdigit() is True and int('²') raises ValueError: the name check takes ASCII digits only."""
    _, cid = digits
    t = Trainer(digits_task(cid), device="cpu")
    t.apply(torch.zeros(t.num_parameters))
    optim = t.optimizer_tensors()
    for bad in ("state.².exp_avg", "state.1" + "0" * 200 + ".exp_avg", "state.٣.exp_avg"):
        hostile = dict(optim)
        hostile[bad] = hostile.pop("state.0.exp_avg")
        with pytest.raises(RecordError, match="unexpected tensor"):
            t.load_state(t.model_bytes(), tensors_bytes(hostile))


def test_state_limits_hold_an_honest_checkpoint(digits, digits_task):
    _, cid = digits
    for extra in ({}, {"optimizer.name": '"sgd"', "optimizer.momentum": "0.9"}):
        t = Trainer(digits_task(cid, **extra), device="cpu")
        t.apply(torch.zeros(t.num_parameters))
        max_model, max_optim = t.state_limits()
        assert len(t.model_bytes()) <= max_model and len(t.optimizer_bytes()) <= max_optim
        # ...and are no more than the tensors' bytes plus header allowance (not the 8 GiB default).
        assert max_model < 4 * len(t.model_bytes()) + 128 * 1024


def test_a_snapshot_keeps_the_bytes_and_the_evaluation_of_its_step_while_the_trainer_moves_on(digits, digits_task):
    """Overlapping checkpoints serialize and evaluate a snapshot while the next span trains."""
    store, cid = digits
    task = digits_task(cid, steps=20, **{"optimizer.name": '"adam"'})
    trainer = Trainer(task, device="cpu")
    data = member_data(store, cid, 0, 1)
    trainer.apply(trainer.compute_gradient(data))
    snapshot = trainer.snapshot()
    model, optim = trainer.model_bytes(), trainer.optimizer_bytes()
    test = list(batched(IPFSDataset(cid, "test", store=store, shuffle=False), 256))
    before = trainer.evaluate(test)
    for _ in range(3):
        trainer.apply(trainer.compute_gradient(data))
    assert trainer.model_bytes() != model and trainer.evaluate(test) != before
    assert snapshot.step == 1 and snapshot.model_bytes() == model and snapshot.optimizer_bytes() == optim
    assert trainer.evaluate_snapshot(snapshot, test) == before


def test_a_users_module_stays_on_the_device_the_user_put_it_on():
    """A run of the user's own module (p2ptrain.Optimizer) trains it where the user's loop feeds it.
    The meta device stands in for a GPU here: before, the trainer moved the module to the CPU
    (``model.to("cpu")``, under the user's loop, whose batches then went to another device than
    its weights; on the meta device the move itself fails)."""
    from torch import nn

    from p2ptrain.task import parse_task
    from p2ptrain.training import GradientBridge, UserTrainer

    task = parse_task({"name": "own", "model": {"name": "user", "architecture": "QmPr27mpm19tVRhDMn98aEecF9ii7FVYZVuQNeTGNTFida"},
                       "training": {"batch_size": 1, "total_steps": 10, "checkpoint_interval": 5}})
    with torch.device("meta"):
        module = nn.Linear(4, 2)
    trainer = UserTrainer(task, module, torch.optim.SGD(module.parameters(), lr=0.1), GradientBridge(), total_steps=10)
    assert trainer.device.type == "meta" and trainer.model is module
    assert all(p.device.type == "meta" for p in module.parameters())
    with pytest.raises(TrainerError, match="give the model"):
        Trainer(task, device=None)


def test_an_optimizer_file_the_users_optimizer_cannot_take_is_refused_and_changes_nothing():
    """A peer's optimizer file of well-formed names whose keys are not what the user's optimizer
    keeps (Adam: exp_avg, exp_avg_sq, step) is a RecordError, and the user's module and optimizer
    are as they were. Before, ``state.0.s`` / ``state.1.k`` reached torch's ``Adam.load_state_dict``,
    which raised a KeyError (no declared error), after the module had already taken the file's
    weights."""
    from torch import nn

    from p2ptrain.protocol import RecordError, tensors_bytes
    from p2ptrain.task import parse_task
    from p2ptrain.training import GradientBridge, UserTrainer

    task = parse_task({"name": "own", "model": {"name": "user", "architecture": "QmPr27mpm19tVRhDMn98aEecF9ii7FVYZVuQNeTGNTFida"},
                       "training": {"batch_size": 1, "total_steps": 10, "checkpoint_interval": 5}})
    torch.manual_seed(0)
    module = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    module(torch.ones(3, 4)).sum().backward()
    optimizer.step()  # the user's loop: Adam now keeps its three keys per parameter
    trainer = UserTrainer(task, module, optimizer, GradientBridge(), total_steps=10)
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    held = {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()}
    other = nn.Linear(4, 2)
    other_model = UserTrainer(task, other, torch.optim.Adam(other.parameters()), GradientBridge(), total_steps=10).model_bytes()
    hostile = [
        {"state.0.s": torch.zeros(2, 4), "state.1.k": torch.zeros(2)},  # keys Adam does not keep
        {"state.0.exp_avg": torch.zeros(2, 4), "state.1.step": torch.tensor(1.0)},  # a partial state
    ]
    for tensors in hostile:
        with pytest.raises(RecordError, match="optimizer"):
            trainer.load_state(other_model, tensors_bytes({"trainer.step": torch.tensor(3), **tensors}))
        assert all(torch.equal(module.state_dict()[k], v) for k, v in weights.items())
        after = optimizer.state_dict()["state"]
        assert after.keys() == held.keys()
        assert all(torch.equal(after[i][k], v) for i, s in held.items() for k, v in s.items())
    module(torch.ones(3, 4)).sum().backward()
    optimizer.step()  # the user's optimizer still steps


def test_a_users_local_sgd_trainer_bounds_a_checkpoint_it_reads_and_loads_an_honest_one():
    """A late joiner of a run of the user's own module in local-SGD mode reads the run's head within
    the trainer's bounds (state_limits), then loads it. Before, those bounds asked the registry's
    optimizer of a task that names none (AssertionError): every resync failed, and the joiner of
    examples/federated.py --local-sgd retried for ever after the others had finished."""
    from torch import nn

    from p2ptrain.task import parse_task
    from p2ptrain.training import GradientBridge, UserLocalSGDTrainer

    task = parse_task({"name": "own", "model": {"name": "user", "architecture": "QmPr27mpm19tVRhDMn98aEecF9ii7FVYZVuQNeTGNTFida"},
                       "training": {"batch_size": 1, "total_steps": 10, "checkpoint_interval": 5,
                                    "mode": "local_sgd", "inner_steps": 4}})

    def trainer() -> UserLocalSGDTrainer:
        module = nn.Linear(4, 2)
        return UserLocalSGDTrainer(task, module, torch.optim.SGD(module.parameters(), lr=0.1), GradientBridge(),
                                   total_steps=10)

    ahead, joiner = trainer(), trainer()
    max_model, max_optim = joiner.state_limits()
    model, optim = ahead.model_bytes(), ahead.optimizer_bytes()
    assert len(model) <= max_model and len(optim) <= max_optim
    joiner.load_state(model, optim)
    assert joiner.model_bytes() == model
