"""A pipelined member's trainer in local-SGD mode (run/_stage_local_sgd.py), without a network: its
stage's inner steps, pseudo-gradient and outer step give, stage by stage, the bits data-parallel
local SGD (:class:`~p2ptrain.training.LocalSGDTrainer`) gives the whole model for the same batches
(a ring of one: every microbatch held); its outer state travels in its stage's optimizer file and
comes back bit for bit; a round that fails leaves the stage as it began. On main a pipelined task in
local-SGD mode was refused by the parser, and this trainer did not exist."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.protocol import read_tensors, RecordError, tensors_bytes
from p2ptrain.run import LocalSGDStagedTrainer
from p2ptrain.task import load_task
from p2ptrain.training import LocalSGDTrainer, loss_and_hits, TrainerError

from .conftest import LM_TASK

INNER = 3
TASK = load_task(
    LM_TASK.replace('name = "sgd"\nlr = 0.1', 'name = "adam"\nlr = 0.01')
    .replace("total_steps = 10", f'total_steps = 10\nmode = "local_sgd"\ninner_steps = {INNER}')
    + "[outer]\noptimizer = \"nesterov\"\n[pipeline]\nstages = 2\n"
)


def batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """An outer step's batches (one per inner step) of the task's language model: 8 windows of 16 tokens."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 61, (8, 16), generator=g), torch.randint(0, 61, (8, 16), generator=g))
            for _ in range(INNER)]


def outer_step(members: list[LocalSGDStagedTrainer], data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One outer step of a pipeline of rings of one: member s holds stage s; each inner step's batch
    goes forward through both stages and back (one microbatch, all of the pass), then each member
    steps its own stage; then each takes its pseudo-gradient and its outer step."""
    for s, member in enumerate(members):
        member.begin_round(s)
    for inner, (x, y) in enumerate(data):
        loss = loss_and_hits(members[1].stages[1](members[0].stages[0](x)), y)[0]
        loss.backward()  # type: ignore[no-untyped-call]
        for s, member in enumerate(members):
            assert member.inner_step_stage(s, inner, 1, 1)
    for s, member in enumerate(members):
        member.pseudo_gradient(s)
        member.apply_outer(s, 1, float(loss.detach()))


def test_a_stage_ring_of_one_takes_the_data_parallel_outer_step_bit_for_bit() -> None:
    whole = LocalSGDTrainer(TASK, device="cpu")
    members = [LocalSGDStagedTrainer(TASK, device="cpu") for _ in range(2)]
    for s, member in enumerate(members):
        member.take_stage(s)
    for step in range(2):
        data = batches(step)
        whole.apply(whole.compute_gradient(iter(data)))
        outer_step(members, data)
    reference = whole.model.state_dict()
    for s, member in enumerate(members):
        assert member.step == whole.step == 2
        held = member.model.state_dict()
        for name in member.stages[s].state_names():
            assert torch.equal(held[name], reference[name]), name
    # The outer momentum: the whole model's flat vector, each stage's part under its parameters' indices.
    momenta = [t for s, member in enumerate(members) for name, t in member.optimizer_tensors().items()
               if name != "trainer.step"]
    assert whole.outer.momentum is not None
    assert torch.equal(torch.cat([t.reshape(-1) for t in momenta]), whole.outer.momentum)


def test_the_outer_state_travels_in_the_stage_file_and_a_failed_round_leaves_the_stage_as_it_began() -> None:
    members = [LocalSGDStagedTrainer(TASK, device="cpu") for _ in range(2)]
    for s, member in enumerate(members):
        member.take_stage(s)
    outer_step(members, batches(0))
    model, optim = members[1].stage_files(1)
    names = set(read_tensors(optim))
    assert names == {"trainer.step"} | {f"state.{i}.outer_momentum" for i in members[1]._stage_indices(1)}
    # A member that loads the stage's files (a joiner, one moved there) holds its bits and outer state:
    # given the same sum of the ring's pseudo-gradients, its next outer step is the replica's own, bit
    # for bit (their inner optimizers differ: each member's own, never in a file).
    joiner = LocalSGDStagedTrainer(TASK, device="cpu")
    joiner.load_stage(1, model, optim, 1)
    assert joiner.optimizer_tensors().keys() == members[1].optimizer_tensors().keys()
    assert all(torch.equal(a, b) for a, b in zip(joiner.optimizer_tensors().values(),
                                                 members[1].optimizer_tensors().values(), strict=True))
    for member in (joiner, members[1]):
        member.begin_round(1)
        member.pseudo_gradient(1)
        for i, p in enumerate(member.stages[1].parameters()):
            p.grad = torch.full_like(p, 0.01 * (i + 1))  # the ring's sum, the same on every replica
        member.apply_outer(1, 2, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(joiner.stages[1].parameters(), members[1].stages[1].parameters(),
                                                 strict=True))
    # That outer step rolled back (it failed elsewhere; the retry plan repeats it): the stage's bits and
    # outer state are the loaded files' again.
    joiner.align(1)
    assert joiner.step == 1 and joiner.stage_files(1) == (model, optim)
    # A round that fails midway: the stage goes back to the weights it began with.
    before = [p.detach().clone() for p in members[1].stages[1].parameters()]
    members[1].begin_round(1)
    for p in members[1].stages[1].parameters():
        p.grad = torch.ones_like(p)
    assert members[1].inner_step_stage(1, 0, 2, 4)  # half the pass's microbatches held
    assert not all(torch.equal(a, b) for a, b in zip(before, members[1].stages[1].parameters(), strict=True))
    members[1].end_round(1)
    assert all(torch.equal(a, b) for a, b in zip(before, members[1].stages[1].parameters(), strict=True))
    # A sync stage's optimizer file (Adam's moments) is no outer state: refused, nothing loaded.
    adam = {"trainer.step": torch.tensor(1), f"state.{min(members[1]._stage_indices(1))}.exp_avg":
            torch.zeros_like(next(members[1].stages[1].parameters()))}
    with pytest.raises(RecordError, match="is no state of stage 1"):
        LocalSGDStagedTrainer(TASK, device="cpu").load_stage(1, model, tensors_bytes(adam), 1)


def test_a_sync_task_has_no_local_sgd_stage_trainer() -> None:
    with pytest.raises(TrainerError, match="local_sgd"):
        LocalSGDStagedTrainer(load_task(LM_TASK + "[pipeline]\nstages = 2\n"), device="cpu")
