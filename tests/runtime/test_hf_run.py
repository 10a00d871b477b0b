"""Hugging Face models through a whole run: two real loopback peers train a 2-layer GPT-2 (``[model]
name = "hf"``) on text files tokenized with a tokenizer trained here; the loss falls, and the model
exported by CID loads with ``transformers`` and gives p2ptrain.load_model's logits. Then a
``save_pretrained`` directory made here is imported (``p2ptrain model import``, a real process)
and fine-tuned as a task's ``initial_model``: the run starts from those weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import pytest
import trio

from p2ptrain.testing import EOS, LocalPeers, local_peers, run_cli, text_corpus
from p2ptrain.protocol import Chain, read_chain

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

DEADLINE_S = 240.0
CONFIG = ('{{ model_type = "gpt2", n_layer = 2, n_embd = 32, n_head = 2, vocab_size = {vocab}, n_positions = 16, '
          'bos_token_id = 0, eos_token_id = 0, resid_pdrop = 0.0, embd_pdrop = 0.0, attn_pdrop = 0.0 }}')
TASK = """\
name = "{name}"
seed = 0
[model]
name = "hf"
config = {config}
"""
REST = """\
[dataset]
manifest = "{manifest}"
[optimizer]
name = "adam"
lr = 0.003
[training]
batch_size = 16
total_steps = {steps}
checkpoint_interval = 10
[peers]
min = 2
max = 2
"""  # both peers join every run: its first term need not wait for more


async def _publish(peers: LocalPeers, root: Path, steps: int, head: str | None = None,
                   manifest: str | None = None) -> tuple[str, str, int]:
    """Store a task (``head``: its text up to the model table; else the config above) and, unless
    ``manifest`` is given, the tokenized corpus it trains on; ``(task CID, manifest, vocabulary)``."""
    from p2ptrain.data import SourceOptions, build_source, read_source
    from p2ptrain.task import load_task, task_bytes

    store = peers[0].content.store

    def build() -> tuple[str, str, int]:
        nonlocal manifest
        vocab = 300
        if manifest is None:
            texts, tokenizer = text_corpus(root)
            source = read_source(f"text:{texts}", SourceOptions(tokenizer=tokenizer, context=16, eos=EOS))
            manifest, made = build_source(store, source, 2)
            assert made.tokens is not None
            vocab = made.tokens.vocab_size
        text = (head or TASK.format(name="gpt2-text", config=CONFIG.format(vocab=vocab)))
        text += REST.format(manifest=manifest, steps=steps)
        cid = store.add_bytes(task_bytes(load_task(text)))
        store.pin_add(cid)
        return cid, manifest, vocab

    return await trio.to_thread.run_sync(build)


def _chain(peer: Any, task_cid: str) -> Chain:
    return read_chain(task_cid, (peer.node.home / "tasks" / task_cid / "chain.jsonl").read_bytes())


async def _run(peers: LocalPeers, task_cid: str) -> list[Any]:
    runs = []
    async with trio.open_nursery() as nursery:
        for peer in peers:
            nursery.start_soon(lambda p: _join(p, task_cid, runs), peer)

    final = await peers.wait_done(task_cid, DEADLINE_S / 2, range(2), what="the run done on both peers")
    assert len({s["latest_model_cid"] for s in final}) == 1
    return runs


async def _join(peer: Any, task_cid: str, runs: list[Any]) -> None:
    runs.append(await peer.tasks.join(task_cid))


async def test_two_peers_train_gpt2_by_config_export_it_and_fine_tune_an_import(tmp_path: Path) -> None:
    import p2ptrain
    from transformers import AutoConfig, AutoModelForCausalLM

    from p2ptrain.training import export_pretrained

    with trio.fail_after(DEADLINE_S):
        async with local_peers(2, tmp_path / "peers") as peers:
            task_cid, manifest, vocab = await _publish(peers, tmp_path / "corpus", 30)
            await _run(peers, task_cid)
            records = [r.record for r in _chain(peers[1], task_cid).records]
            assert [r.step for r in records] == [10, 20, 30] and all(len(r.members) == 2 for r in records)
            assert records[0].metrics["loss"] > records[-1].metrics["loss"], [r.metrics for r in records]

            # Export: a directory transformers loads, with the logits p2ptrain.load_model gives.
            store = peers[1].content.store
            exported = export_pretrained(store.cat(records[-1].model_cid), tmp_path / "exported")
            theirs = AutoModelForCausalLM.from_pretrained(exported).eval()
            ours = p2ptrain.load_model(records[-1].model_cid, store=store)
            x = torch.randint(0, vocab, (2, 16))
            with torch.no_grad():
                assert torch.equal(theirs(x).logits, ours(x))

            # Import a save_pretrained directory of another model and fine-tune it.
            config = AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=vocab, n_positions=16,
                                          bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                          attn_pdrop=0.0)
            torch.manual_seed(11)
            pretrained = AutoModelForCausalLM.from_config(config)
            with torch.no_grad():
                pretrained.transformer.ln_f.bias.fill_(0.125)  # not what any seed gives
            pretrained.save_pretrained(tmp_path / "pretrained")
            out = await trio.to_thread.run_sync(
                lambda: run_cli("model", "import", str(tmp_path / "pretrained"), "--home", str(peers[0].node.home),
                                "--json"))
            imported = json.loads(out)
            assert 'name = "hf"' in imported["toml"] and f'initial_model = "{imported["model_cid"]}"' in imported["toml"]
            loaded = p2ptrain.load_model(imported["model_cid"], store=peers[0].content.store)
            with torch.no_grad():
                assert torch.equal(loaded(x), pretrained.eval()(x).logits)

            # The task a user writes from what the command printed: its initial_model and [model] table.
            head = imported["toml"].replace("\n\n[model]", '\nname = "gpt2-tune"\n[model]')
            tune_cid = (await _publish(peers, tmp_path, 10, head=head, manifest=manifest))[0]
            runs = await _run(peers, tune_cid)
            assert all(run.shared.initial_cid == imported["model_cid"] for run in runs)  # loaded, serialized again
            first = _chain(peers[0], tune_cid).records[0].record
            assert first.parent == imported["model_cid"] and first.step == 10
