"""What ``p2ptrain.Optimizer`` refuses, in one clear line each, losing nothing: another model or
other options than the run's (naming the first difference), a model with no parameters, a step
before backward, a non-finite gradient. Members run in this process (each on its own thread and
home), on loopback. One first member, under way in run "inputs", serves every test of the module
(:func:`first`): starting one costs ~10 s of waits (its join window, listening for the run's head,
term 0, the first plan's grace), and no test here needs it fresh."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

import p2ptrain
from p2ptrain.base import UserError
from p2ptrain.node import free_port


def _net(width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3))


def _options(home: Path, **more: object) -> dict[str, object]:
    return {"run": "inputs", "home": home, "listen": [f"/ip4/127.0.0.1/tcp/{free_port()}"], "min_peers": 1,
            "checkpoint_every": 5, "total_steps": 1000, "join_window_s": 3.0, **more}


def _step(opt: p2ptrain.Optimizer, model: nn.Module) -> None:
    opt.zero_grad()
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()


@dataclass
class First:
    opt: p2ptrain.Optimizer
    model: nn.Module
    home: Path
    metrics_port: int


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory, quick_timers_for_module: None) -> Iterator[First]:
    """A member alone in run "inputs" (min_peers 1), under way: two steps taken, serving Prometheus
    metrics. Nobody else starts with it: a short window (the others, started later, find its run
    under way). Closed after the module's tests, and no thread of theirs or its own is left. The
    members here run in this process, so the protocol's idle waits are the tests' (tests/conftest.py,
    quick_timers), for this member and those the tests start."""
    before = set(threading.enumerate())  # the worker's threads of earlier modules are not this one's
    home = tmp_path_factory.mktemp("first") / "a"
    metrics_port = free_port()
    model = _net()
    opt = p2ptrain.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                             **_options(home, join_window_s=0.5, metrics=f"127.0.0.1:{metrics_port}"))
    try:
        _step(opt, model)
        _step(opt, model)
        yield First(opt, model, home, metrics_port)
    finally:
        opt.close()
    # This module's threads only: under the suite's longest-first order a worker runs this module
    # after others whose threads may linger (63 in all once, with 7 of this module's). What stays
    # here alone: py-libp2p's timed caches' cleanup threads and trio's idle thread cache (10 s).
    left = [t.name for t in threading.enumerate() if t not in before]
    assert len(left) < 40, sorted(left)


def test_a_member_with_another_width_or_learning_rate_is_refused_naming_it(tmp_path: Path, first: First) -> None:
    boot = first.opt.addresses
    wide = _net(width=48)
    with pytest.raises(UserError, match=r"0\.weight") as refused:
        p2ptrain.Optimizer(torch.optim.SGD(wide.parameters(), lr=0.1), model=wide,
                           **_options(tmp_path / "b", bootstrap=boot))
    assert "48" in str(refused.value) and "\n" not in str(refused.value)
    same = _net()
    with pytest.raises(UserError, match=r"\blr\b") as refused:
        p2ptrain.Optimizer(torch.optim.SGD(same.parameters(), lr=0.2), model=same,
                           **_options(tmp_path / "c", bootstrap=boot))
    assert "\n" not in str(refused.value)


def test_bad_input_is_one_clear_error_and_changes_nothing(tmp_path: Path, first: First) -> None:
    with pytest.raises(ValueError, match="no parameters"):
        p2ptrain.Optimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), model=nn.ReLU(),
                           **_options(tmp_path / "empty"))
    opt, model = first.opt, first.model
    before = [p.detach().clone() for p in model.parameters()]
    steps = opt.step_count
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="before backward"):
        opt.step()
    model(torch.randn(4, 8)).sum().backward()
    next(iter(model.parameters())).grad[0, 0] = float("nan")  # type: ignore[index]
    with pytest.raises(FloatingPointError, match=r"0\.weight.*not finite"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.step_count == steps
    _step(opt, model)  # and the run goes on
    assert opt.step_count == steps + 1


def test_a_run_of_a_users_module_is_loaded_and_served_into_the_users_instance_not_built(first: First) -> None:
    """No builder exists for a user's module: ``load_model`` and ``model serve`` say so in one line;
    ``load_state`` and ``p2ptrain.serve(cid, model=instance)`` take the user's instance; the file
    must fit it exactly. The run's member serves Prometheus metrics like a node."""
    import trio

    from p2ptrain.serve import open_model, predict
    from p2ptrain.training._loading import NoBuilder

    import urllib.request

    opt, model, home = first.opt, first.model, first.home
    while opt.step_count < 5:
        _step(opt, model)
    cid = opt.wait_confirmed(5, timeout=120)
    with urllib.request.urlopen(f"http://127.0.0.1:{first.metrics_port}/metrics", timeout=30) as page:
        exposition = page.read().decode()
    assert f'p2ptrain_task_step{{task="{opt.run_cid}"}}' in exposition  # Prometheus sees the run
    with pytest.raises(NoBuilder, match="load_state") as no_builder:
        p2ptrain.load_model(cid, home=home)
    assert "\n" not in str(no_builder.value)
    fresh = p2ptrain.load_state(_net(), cid, home=home)
    with pytest.raises(UserError, match="does not fit"):
        p2ptrain.load_state(_net(width=16), cid, home=home)
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = fresh.eval()(x)
    server = open_model(cid, home=home, model=_net(), input_shape=(8,), listen="127.0.0.1:0")

    async def ask() -> dict[str, object]:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                url = await nursery.start(server.run)
                answer = await trio.to_thread.run_sync(predict, url, x.tolist())
                nursery.cancel_scope.cancel()
        return answer  # type: ignore[no-any-return]

    answer = trio.run(ask)
    assert answer["model_cid"] == cid
    assert torch.allclose(torch.tensor(answer["outputs"]), expected, atol=1e-6)


def test_an_allowlisted_member_never_takes_a_strangers_task_of_the_same_name(tmp_path: Path, first: First) -> None:
    """A stranger's run of the same name is under way; a member whose run is allowlisted does not
    take it (nor load its weights) and starts the run of its own list."""
    from p2ptrain.base import load_or_create_identity, peer_id_of

    stranger = first.opt
    home = tmp_path / "listed"
    home.mkdir(mode=0o700)
    me = peer_id_of(load_or_create_identity(home)).to_base58()
    model = _net()
    with p2ptrain.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                            **_options(home, bootstrap=stranger.addresses, allow=[me])) as listed:
        assert listed.run_cid != stranger.run_cid
        _step(listed, model)
        assert listed.step_count == 1


def test_train_default_optimizer_takes_the_fast_kernel_and_earns_no_warning() -> None:
    """``p2ptrain.train`` without ``optimizer=`` warned that the Adam it chose itself was slow on
    sparse averages ("pass fused=True"): the user had chosen nothing. Its default is now fused, and
    takes a step on the mostly zero gradient a sparse average leaves."""
    from p2ptrain.training import slow_on_sparse
    from p2ptrain.api._train import _optimizer

    model = _net()
    opt = _optimizer(None, model)
    assert not slow_on_sparse(opt, density=0.1)
    assert slow_on_sparse(torch.optim.Adam(model.parameters(), lr=1e-3), density=0.1)  # the user's own: warned
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
        p.grad.view(-1)[0] = 1.0
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
