"""`p2ptrain model verify` on a pipelined run's record (issue 31, F1): each stage's entry in the
manifest must carry the signatures of a quorum of that stage's replicas, checked by someone who took
no part. A chain of one record over 4 members (two stages of two replicas), signed and attested
with real keys, whose manifest names real stage files; the command itself, in a process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.cli.verify import _initial_cid
from p2ptrain.ipfs import open_store
from p2ptrain.protocol import ChainRules, sign_statement
from p2ptrain.protocol._lineage import entry_bytes
from p2ptrain.protocol.signing import peer_str
from p2ptrain.run import RunDir
from p2ptrain.run._stage_trainer import StagedTrainer
from p2ptrain.task import load_task, task_bytes
from p2ptrain.testing import proven_chain, run_forked
from p2ptrain.training import manifest_bytes, StageFile

from .conftest import LM_TASK

TASK = load_task(LM_TASK + "[pipeline]\nstages = 2\n")  # peers.min = 4
KEYS = [create_new_key_pair(bytes([i + 1]) * 32) for i in range(4)]
RINGS = [KEYS[:2], KEYS[2:]]
STEP = 10  # proven_chain's first record


def chain_of(home: Path, signers: list[list[int]]) -> str:
    """A chain in ``home`` of one record naming a manifest of the task's stage files, stage ``i``'s
    entry signed by ``signers[i]`` (indices into its ring). Returns the task's CID."""
    store = open_store(home)
    task_cid = str(store.add_bytes(task_bytes(TASK)))
    trainer = StagedTrainer(TASK, device="cpu")
    entries = []
    for i, stage in enumerate(trainer.stages):
        model, optim = trainer.stage_files(i)
        cids = (str(store.add_bytes(model)), str(store.add_bytes(optim)))
        ring = RINGS[i]
        signatures = tuple((peer_str(ring[k]), sign_statement(task_cid, STEP, i, cids, ring[k]).signature)
                           for k in signers[i])
        entries.append(StageFile(stage.first, stage.last, *cids, trainer.stage_numbers(i),
                                 tuple(peer_str(k) for k in ring), signatures))
    manifest = str(store.add_bytes(manifest_bytes(entries)))
    chain = proven_chain(task_cid, _initial_cid(store, TASK), [manifest], KEYS, rules=ChainRules.of(TASK, task_cid))
    path = RunDir.of(home, task_cid).chain
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(entry_bytes(e) + b"\n" for e in chain.entries))
    return task_cid


def verify(home: Path, task_cid: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "p2ptrain.cli.main", "model", "verify", "--latest", task_cid, "--home", str(home)]
    return run_forked(cmd, capture_output=True, text=True, timeout=120)


def test_a_stage_signed_by_less_than_a_quorum_of_its_replicas_breaks_the_lineage(tmp_path: Path) -> None:
    task_cid = chain_of(tmp_path / "short", [[0, 1], [1]])  # stage 1: one of its two replicas
    broken = verify(tmp_path / "short", task_cid)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    breaks = [line for line in broken.stdout.splitlines() if line.startswith("BREAK")]
    assert len(breaks) == 1 and "stage 1's files are signed by 1 of its 2 replicas, not a quorum (2)" in breaks[0], \
        broken.stdout

    task_cid = chain_of(tmp_path / "whole", [[0, 1], [0, 1]])
    ok = verify(tmp_path / "whole", task_cid)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "each stage's files signed by a quorum of its replicas" in ok.stdout
