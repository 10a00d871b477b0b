"""A replica keeps the graphs of its last FORWARDs per sender, so that the BACKWARD a driver sends
back to it skips the recomputed forward: the same gradients to the bit, and only for the same
sender, step, microbatch and input (docs/pipeline.md, "The stage protocol")."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.models._registry import build_model
from p2ptrain.pipeline import partition, StageReplica
from p2ptrain.wire.activations import Frame, Kind

from tests.pipeline.test_stages import batch, lm_loss, LM, pipeline_run, pipeline_step, REPLICAS, SEED, STAGES

A, B = "driver-a", "driver-b"  # senders: the replica keys what it keeps by them, nothing else here


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def replica(keep_graphs: int = 2) -> StageReplica:
    """A replica of stage 1 (its tensors computed directly: no host is needed for ``_compute``)."""
    stage = partition(build_model("transformer_lm", LM, seed=SEED), STAGES)[1]
    r = StageReplica(None, stage, lm_loss, senders=[A, B], keep_graphs=keep_graphs)  # type: ignore[arg-type]
    r.new_step(1)
    return r


def activation(seed: int) -> torch.Tensor:
    return torch.randn(2, LM["context"], LM["width"], generator=torch.Generator().manual_seed(seed))


def forward(r: StageReplica, sender: str, mb: int, x: torch.Tensor) -> torch.Tensor:
    return r._compute(Frame(Kind.FORWARD, r.step, mb, 1, tensors=(x,)), sender)[0].tensors[0]


def backward(r: StageReplica, sender: str, mb: int, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    """The input's gradient then every parameter's, as the replica answers and accumulates them."""
    answer, grads = r._compute(Frame(Kind.BACKWARD, r.step, mb, 1, tensors=(x.clone(), g)), sender)
    return [answer.tensors[0], *grads]


def assert_same(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_a_backward_after_its_forward_reuses_the_graph_and_gives_the_same_bits():
    x, g = activation(1), activation(2)
    keeping, recomputing = replica(), replica(keep_graphs=0)
    assert torch.equal(forward(keeping, A, 5, x), forward(recomputing, A, 5, x))
    assert_same(backward(keeping, A, 5, x, g), backward(recomputing, A, 5, x, g))
    assert (keeping.reused, recomputing.reused) == (1, 0)
    # The graph went with its BACKWARD: a retry of it recomputes, to the same bits.
    assert_same(backward(keeping, A, 5, x, g), backward(recomputing, A, 5, x, g))
    assert keeping.reused == 1


def test_a_kept_graph_serves_only_its_sender_step_microbatch_and_input():
    x, other, g = activation(1), activation(3), activation(2)
    r, reference = replica(), replica(keep_graphs=0)
    forward(r, A, 5, x)
    # Another input under the same id (a driver that changed its mind, or lies): recomputed for it.
    assert_same(backward(r, A, 5, other, g), backward(reference, A, 5, other, g))
    forward(r, A, 5, x)
    assert_same(backward(r, B, 5, x, g), backward(reference, B, 5, x, g))  # another sender's id
    assert_same(backward(r, A, 6, x, g), backward(reference, A, 6, x, g))  # another microbatch
    r.new_step(2)  # the weights may have changed: nothing of step 1 is kept
    reference.new_step(2)
    assert_same(backward(r, A, 5, x, g), backward(reference, A, 5, x, g))
    assert r.reused == 0


def test_a_replica_keeps_a_bounded_number_of_graphs_per_sender():
    r = replica(keep_graphs=2)
    xs = [activation(i) for i in range(4)]
    for mb, x in enumerate(xs):
        forward(r, A, mb, x)
    forward(r, B, 0, xs[0])  # another sender's FORWARD evicts none of A's
    g = activation(9)
    for mb, x in enumerate(xs):
        backward(r, A, mb, x, g)
    assert r.reused == 2  # the two newest of A's four; the oldest two were dropped
    backward(r, B, 0, xs[0], g)
    assert r.reused == 3


def test_the_last_stage_keeps_nothing():
    stage = partition(build_model("transformer_lm", LM, seed=SEED), STAGES)[-1]
    assert StageReplica(None, stage, lm_loss, senders=[A]).keep_graphs == 0  # type: ignore[arg-type]


async def test_every_backward_of_a_step_goes_back_to_the_replica_that_kept_its_graph():
    async with pipeline_run() as members:
        x, y = batch(1)
        await pipeline_step(members, 1, x, y, micro=2)
        microbatches = x.shape[0] // 2
        middle = [m.server for m in members if m.server and 0 < m.stage.index < STAGES - 1]
        assert len(middle) == REPLICAS * (STAGES - 2)
        assert sum(r.reused for r in middle) == microbatches * (STAGES - 2)


def test_a_second_opinion_on_a_backward_answers_its_gradient_and_accumulates_nothing():
    """CHECK_BACKWARD (protocol 1.2.0): the input's gradient a BACKWARD answers, to the bit, whether
    the replica kept the FORWARD's graph or not, and no parameter gradient to accumulate."""
    x, g = activation(1), activation(2)
    keeping, reference = replica(), replica(keep_graphs=0)
    forward(keeping, A, 5, x)
    answer, grads = keeping._compute(Frame(Kind.CHECK_BACKWARD, 1, 5, 1, tensors=(x.clone(), g)), A)
    assert grads is None and answer.kind == Kind.GRAD
    assert torch.equal(answer.tensors[0], backward(reference, A, 5, x, g)[0])
    assert keeping.reused == 1
    recomputed, grads = reference._compute(Frame(Kind.CHECK_BACKWARD, 1, 6, 1, tensors=(x.clone(), g)), A)
    assert grads is None and torch.equal(recomputed.tensors[0], answer.tensors[0])
