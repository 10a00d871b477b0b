"""A Hugging Face causal LM (``[model] name = "hf"``, a Llama by config) cut into pipeline stages
(issue 31: "a Hugging Face causal LM's decoder layers once hf models exist"): 3 stages (embedding
and a layer, a layer, norm and head) on three full peers in this process. Its first checkpoint,
assembled from the stages' files, is the model one process trains with the same seed and the same
global batch (fp32 activations: within float rounding), and `model verify --eval` assembles and
evaluates it. The cut's own exactness, family by family, is tests/models/test_hf_pieces.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from p2ptrain.api import split_shards
from p2ptrain.cli.verify import verify
from p2ptrain.testing import local_peers

from .test_pipelined_run import INTERVAL, publish, single_process, small_text, whole_model  # noqa: F401 (small_text: autouse)

pytestmark = pytest.mark.usefixtures("quick_timers_slow_joins")  # tests/conftest.py: idle waits shortened, not the grace

pytest.importorskip("transformers")

DEADLINE_S = 240.0
STEP_S = 120.0
# peers.max 3: its three members, all from the run's start (term 0 and the first plan need not wait for more)
TASK = """\
name = "pipelined-hf"
seed = 5
[model]
name = "hf"
[model.config]
model_type = "llama"
vocab_size = 256
hidden_size = 16
intermediate_size = 32
num_hidden_layers = 2
num_attention_heads = 2
num_key_value_heads = 1
max_position_embeddings = 128
[dataset]
manifest = "{manifest}"
[optimizer]
name = "sgd"
lr = 0.5
[training]
batch_size = 4
total_steps = 16
checkpoint_interval = 2
[peers]
min = 3
max = 3
[pipeline]
stages = 3
microbatch_size = 2
activations = "fp32"
check_fraction = 0.0
"""


async def test_an_hf_llama_cut_into_stages_trains_as_one_process(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            manifest, task_cid = await publish(peers, TASK)
            await peers.join_all(task_cid)

            def first_record() -> Any:
                for i in range(len(peers)):
                    status = peers.status(i, task_cid)
                    assert status.get("state") != "failed", status.get("error")
                run = peers[0].tasks.runs[task_cid].shared
                records = run.book.chain.records if run.book else []
                return records[0].record if records else None

            record = await peers.wait_until(first_record, STEP_S, what="model v1")
            status = peers.status(0, task_cid)
            assert [len(e["replicas"]) for e in status["stages"]] == [1, 1, 1]
            confirmed = await whole_model(peers[0], record.model_cid)
            expected = await trio.to_thread.run_sync(
                single_process, TASK.format(manifest=manifest), peers[0].content.store, manifest, record.members,
                INTERVAL)
            assert record.step == INTERVAL
            assert set(confirmed) == set(expected) and any(name.startswith("model.model.layers.1.") for name in expected)
            for name, tensor in expected.items():
                torch.testing.assert_close(confirmed[name], tensor, rtol=1e-5, atol=1e-6, msg=name)

            # model verify assembles the hf model from the manifest's stage files and evaluates it.
            home = peers[0]
            for cid in split_shards(home.content.store, manifest, "test"):
                await home.content.fetch(cid)
            report = await trio.to_thread.run_sync(lambda: verify(
                home.node.home, model_cid=record.model_cid, task_cid=task_cid, bootstrap=[], evaluate=True))
            assert report.problems == [], report.problems
            assert report.eval is not None and report.eval["recomputed"]["loss"] > 0, report.eval
