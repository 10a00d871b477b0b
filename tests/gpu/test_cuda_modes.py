"""The CUDA path beyond the registry's MLP in sync mode: a local-SGD run (DiLoCo outer steps, sparse
2-bit pseudo-gradients) and a Hugging Face GPT-2 run and a torchvision ResNet-18 run, each among in-process peers on one GPU.

What every run must show on a GPU is what lets its members attest each other: every member's own
weights hash to the confirmed model CID (not only a quorum's), and that model loads on the CPU.

Every test skips where torch sees no CUDA device; docs/deploy.md#gpus says on which card and when
they last ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trio

from p2ptrain.services import TaskOptions
from p2ptrain.testing import EOS, LocalPeers, local_peers, text_corpus
from p2ptrain.training import model_from_bytes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch.cuda.is_available() is False here)")

DEADLINE_S = 150.0

LOCAL_SGD_TASK = """\
name = "cuda-local-sgd"
seed = 0
[model]
name = "mlp"
kwargs = {{ in_features = 64, hidden = [64], out_features = 10 }}
[dataset]
manifest = "{manifest}"
[optimizer]
name = "adam"
lr = 0.005
[training]
batch_size = 16
mode = "local_sgd"
inner_steps = 10
total_steps = 12
checkpoint_interval = 4
[outer]
optimizer = "average"
[compression]
density = 0.1
values = "2bit"
[requirements]
device = "cuda"
[peers]
min = 3
max = 3
"""

HF_TASK = """\
name = "cuda-gpt2"
seed = 0
[model]
name = "hf"
config = {{ model_type = "gpt2", n_layer = 2, n_embd = 32, n_head = 2, vocab_size = {vocab}, n_positions = 16, \
bos_token_id = 0, eos_token_id = 0, resid_pdrop = 0.0, embd_pdrop = 0.0, attn_pdrop = 0.0 }}
[dataset]
manifest = "{manifest}"
[optimizer]
name = "adam"
lr = 0.003
[training]
batch_size = 16
total_steps = 30
checkpoint_interval = 10
[compression]
density = 0.5
[requirements]
device = "cuda"
[peers]
min = 2
max = 2
"""


async def _store_task(peers: LocalPeers, make_text: Any) -> str:
    from p2ptrain.task import load_task, task_bytes

    store = peers[0].content.store

    def build() -> str:
        cid = store.add_bytes(task_bytes(load_task(make_text(store))))
        store.pin_add(cid)
        return cid

    return await trio.to_thread.run_sync(build)


async def _run_to_the_end(peers: LocalPeers, task_cid: str) -> tuple[list[Any], list[dict[str, Any]]]:
    """Every peer joins ``task_cid``; the runs and their statuses once every member is done, with one
    confirmed model CID that every member's own weights hash to."""
    runs: list[Any] = []

    async def join(peer: Any) -> None:
        runs.append(await peer.tasks.join(task_cid))

    async with trio.open_nursery() as nursery:
        for peer in peers:
            nursery.start_soon(join, peer)

    def done() -> list[dict[str, Any]] | None:
        statuses = [peers.status(i, task_cid) for i in range(len(peers))]
        for status in statuses:
            assert status.get("state") != "failed", status.get("error")
        return statuses if all(s.get("state") == "done" for s in statuses) else None

    statuses = await peers.wait_until(done, DEADLINE_S, what="every member done")
    assert len({s["latest_model_cid"] for s in statuses}) == 1, statuses
    cid = statuses[0]["latest_model_cid"]
    for peer in peers:
        run = peer.tasks.runs[task_cid]
        trainer = run.shared.trainer
        assert trainer is not None and trainer.device.type == "cuda"
        assert all(p.is_cuda for p in trainer.params)
        own = await trio.to_thread.run_sync(lambda: peer.content.store.add_bytes(trainer.model_bytes(), only_hash=True))
        assert str(own) == cid, f"{peer.node.peer_id}: its weights are not the confirmed model's"
    return runs, statuses


@pytest.mark.timeout(DEADLINE_S + 60)
async def test_a_local_sgd_run_on_cuda_confirms_every_members_own_bits_and_learns(tmp_path: Path) -> None:
    """Outer steps of 10 inner Adam steps on the GPU, 2-bit sparse pseudo-gradients averaged by the
    ring (from and back to the GPU): every checkpoint confirmed, every member's own bits are the
    confirmed model's, and that model (loaded on the CPU) beats the initial weights."""
    from sklearn.datasets import load_digits

    from p2ptrain.data import build_dataset, load_source
    from p2ptrain.training import LocalSGDTrainer

    def text(store: Any) -> str:
        name, features, labels = load_source("sklearn:digits")
        manifest, _ = build_dataset(store, name, (features / 16.0).astype(np.float32), labels, 3, test_fraction=0.2)
        return LOCAL_SGD_TASK.format(manifest=manifest)

    with trio.fail_after(DEADLINE_S + 30):
        async with local_peers(3, tmp_path, task_options=TaskOptions(device="cuda")) as peers:
            task_cid = await _store_task(peers, text)
            runs, statuses = await _run_to_the_end(peers, task_cid)
            assert all(isinstance(run.shared.trainer, LocalSGDTrainer) for run in runs)
            assert [e["step"] for e in statuses[0]["chain"]] == [4, 8, 12]
            store = peers[0].content.store
            final = model_from_bytes(store.cat(statuses[0]["latest_model_cid"]))
            initial = model_from_bytes(store.cat(runs[0].shared.initial_cid))
            assert all(t.device.type == "cpu" for t in final.state_dict().values())
    x, y = load_digits(return_X_y=True)
    inputs = torch.tensor((x / 16.0).astype(np.float32))

    def accuracy(module: torch.nn.Module) -> float:
        with torch.no_grad():
            return float((module.eval()(inputs).argmax(1) == torch.tensor(y)).float().mean())

    before, after = accuracy(initial), accuracy(final)
    assert after >= before + 0.3 and after >= 0.6, (before, after)


@pytest.mark.timeout(DEADLINE_S + 60)
async def test_a_gpt2_run_on_cuda_confirms_every_members_own_bits_and_its_loss_falls(tmp_path: Path) -> None:
    """A 2-layer GPT-2 built by ``transformers`` from its config trains on the GPU among two peers:
    every member's own bits are the confirmed model's, the recorded loss falls, and the model loads
    on the CPU with the logits the GPU's weights give."""
    import p2ptrain
    from p2ptrain.data import SourceOptions, build_source, read_source
    from p2ptrain.protocol import read_chain

    def text(store: Any) -> str:
        texts, tokenizer = text_corpus(tmp_path / "corpus")
        source = read_source(f"text:{texts}", SourceOptions(tokenizer=tokenizer, context=16, eos=EOS))
        manifest, made = build_source(store, source, 2)
        assert made.tokens is not None
        return HF_TASK.format(manifest=manifest, vocab=made.tokens.vocab_size)

    with trio.fail_after(DEADLINE_S + 30):
        async with local_peers(2, tmp_path / "peers", task_options=TaskOptions(device="cuda")) as peers:
            task_cid = await _store_task(peers, text)
            runs, statuses = await _run_to_the_end(peers, task_cid)
            chain = read_chain(task_cid, (peers[0].node.home / "tasks" / task_cid / "chain.jsonl").read_bytes())
            records = [r.record for r in chain.records]
            assert [r.step for r in records] == [10, 20, 30]
            assert records[0].metrics["loss"] > records[-1].metrics["loss"], [r.metrics for r in records]
            cid = statuses[0]["latest_model_cid"]
            on_cpu = p2ptrain.load_model(cid, store=peers[0].content.store)
            gpu_model = runs[0].shared.trainer.model
            x = torch.randint(0, 64, (2, 16))
            with torch.no_grad():
                theirs = gpu_model.eval()(x.cuda())
                theirs = (theirs.logits if hasattr(theirs, "logits") else theirs).float().cpu()
                ours = on_cpu.eval()(x)
            assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


RESNET_TASK = """\
name = "cuda-resnet18"
seed = 0
[model]
name = "torchvision:resnet18"
kwargs = {{ num_classes = 10, in_channels = 1 }}
[dataset]
manifest = "{manifest}"
[optimizer]
name = "adam"
lr = 0.001
[training]
batch_size = 16
total_steps = 12
checkpoint_interval = 6
[requirements]
device = "cuda"
[peers]
min = 2
max = 2
"""


@pytest.mark.timeout(DEADLINE_S + 60)
async def test_a_torchvision_resnet_run_on_cuda_confirms_every_members_own_bits(tmp_path: Path) -> None:
    """A ResNet-18 (cuDNN convolutions, BatchNorm) on an image folder among two peers on the GPU.
    cuDNN's convolution gradients are not bitwise reproducible (two trainers fed the same batch
    differ after one step on an H100), which the run does not need: a member's own gradient only
    goes into the average, every member applies the same averaged gradient, and the BatchNorm
    buffers are averaged at each checkpoint. So every member's own bits are the confirmed model's."""
    pytest.importorskip("torchvision", reason="torchvision does not import beside this torch")
    from PIL import Image
    from sklearn.datasets import load_digits

    from p2ptrain.data import SourceOptions, build_source, read_source

    digits = load_digits()
    for i in range(200):
        folder = tmp_path / "digits" / f"digit{digits.target[i]}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((digits.images[i] * (255 / 16)).astype(np.uint8)).save(folder / f"{i:04d}.png")

    def text(store: Any) -> str:
        source = read_source(str(tmp_path / "digits"), SourceOptions(image_size=(16, 16)))
        manifest, _ = build_source(store, source, 2)
        return RESNET_TASK.format(manifest=manifest)

    with trio.fail_after(DEADLINE_S + 30):
        async with local_peers(2, tmp_path / "peers", task_options=TaskOptions(device="cuda")) as peers:
            task_cid = await _store_task(peers, text)
            _, statuses = await _run_to_the_end(peers, task_cid)
            assert [e["step"] for e in statuses[0]["chain"]] == [6, 12]
            on_cpu = model_from_bytes(peers[0].content.store.cat(statuses[0]["latest_model_cid"]))
            assert all(t.device.type == "cpu" for t in on_cpu.state_dict().values())
