"""bench/pipeline_baseline.py's ranks, at tiny size on loopback: the baseline of issue 31's comparison
is only worth its numbers if its S x R processes train the model the single process trains.

Two stages x two replicas of a 2-block ``transformer_lm``, each rank the bench's own ``worker`` in a
forked process (the bench launches fresh interpreters, whose imports of torch take ~10 s apiece here;
a fork of this one starts at once), gloo over 127.0.0.1; each writes its result as JSON. The loss of
every step must equal the single-process run's on the same global batches: it does not when a
replica's gradients are not averaged, or the batch's rows or the stages' cut go astray.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

BENCH = Path(__file__).resolve().parents[2] / "bench"
JOIN_TIMEOUT_S = 60.0

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")


def _bench():
    """bench/pipeline_baseline.py (bench/ is scripts, not a package)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("pipeline_baseline")


def _rank(argv: list[str], out: Path) -> None:
    out.write_text(json.dumps(_bench().worker(_bench().parse(argv))))


def test_stages_and_replicas_train_as_one_process(tmp_path: Path) -> None:
    bench = _bench()
    config = ["--depth", "2", "--width", "32", "--heads", "2", "--context", "16", "--stages", "2", "--replicas", "2",
              "--batch", "8", "--micro", "2", "--steps", "2", "--reps", "1", "--lr", "0.5"]
    port = bench.free_port()
    fork = multiprocessing.get_context("fork")
    procs = [fork.Process(target=_rank, args=([*config, "--rank", str(i), "--master", "127.0.0.1", "--port", str(port),
                                               "--iface", "lo"], tmp_path / f"{i}.json")) for i in range(4)]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(JOIN_TIMEOUT_S)
            assert proc.exitcode == 0, f"rank exited with {proc.exitcode}"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    ranks = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(4)]
    args = bench.parse(config)
    result = bench.summary(args, ranks, bench.single(args), [0.0, 0.0])

    assert [r["stage"] for r in ranks] == [0, 1, 0, 1] and [r["replica"] for r in ranks] == [0, 0, 1, 1]
    assert result["bounds"] == [0, 2, 4]  # embedding + block 0 | block 1 + norm + head
    assert result["parameters"] == 42_624 and ranks[0]["parameters"] == ranks[2]["parameters"]
    assert len(result["losses"]) == 3 and result["losses"][0] != result["losses"][-1]  # it trained
    for pipelined, alone in zip(result["losses"], result["single_losses"], strict=True):
        assert pipelined == pytest.approx(alone, rel=1e-5)
    assert result["tokens_per_s"] > 0 and all(mb > 0 for mb in result["peak_rss_mb"])
    assert result["bytes_per_step_computed"]["activations"] == 2 * 1 * 8 * 16 * 32 * 4
