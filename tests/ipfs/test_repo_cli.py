"""``p2ptrain repo verify`` and ``p2ptrain repo gc`` on real block stores, through the installed command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.task import TASK_TEMPLATE, load_task, task_bytes
from p2ptrain.data import build_dataset
from p2ptrain.ipfs import BlockStore, EmbeddedStore, cid_str, make_cid, parse_cid
from p2ptrain.testing import proven_record, run_forked
from p2ptrain.protocol._lineage import entry_bytes
from p2ptrain.wire import ConfirmedRecord, ModelRecord

P2PTRAIN = str(Path(sys.executable).with_name("p2ptrain"))


def repo(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return run_forked([P2PTRAIN, "repo", *args, "--home", str(home)], capture_output=True, text=True,
                      timeout=120)


def noise(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def blocks_of(store: EmbeddedStore, cid: str) -> set[bytes]:
    """The multihashes of a file's blocks, read before anything is collected."""
    from p2ptrain.ipfs import walk_dag

    return {c.digest for c in walk_dag(parse_cid(cid), store.blocks.get)}


def held(store: EmbeddedStore) -> set[bytes]:
    return {c.digest for c in store.blocks.iter_cids()}


def test_verify_lists_a_corrupted_block_and_exits_1(tmp_path):
    store = EmbeddedStore(tmp_path)
    cid = store.add_bytes(noise(600_000, 1))  # three blocks
    clean = repo("verify", home=tmp_path)
    assert clean.returncode == 0, clean.stderr
    assert "verified 4 blocks" in clean.stdout and ": 0 bad" in clean.stdout

    victim = next(iter(store.blocks.block_files()))
    victim.write_bytes(b"rotten" + victim.read_bytes()[6:])
    bad = repo("verify", "--json", home=tmp_path)
    assert bad.returncode == 1, bad.stderr
    report = json.loads(bad.stdout)
    assert report["blocks"] == 4
    assert [b["path"] for b in report["bad"]] == [str(victim)]
    assert parse_cid(report["bad"][0]["cid"]).digest in blocks_of_names(victim)
    text = repo("verify", home=tmp_path)
    assert text.returncode == 1 and str(victim) in text.stdout and "1 bad" in text.stdout
    assert victim.exists()  # verify only reads; a reader is what quarantines it (and refetches)
    assert not store.has(cid)
    assert (store.blocks.root / "quarantine" / victim.name).exists()


def blocks_of_names(path: Path) -> set[bytes]:
    import base64

    key = path.name[: -len(".data")]
    return {base64.b32decode(key + "=" * (-len(key) % 8))}


def _task_home(tmp_path: Path) -> tuple[EmbeddedStore, dict[str, set[bytes]], set[bytes]]:
    """A home as a node leaves it: pins, a task it took part in (task file, dataset, a confirmed
    checkpoint in chain.jsonl, the chain's CID), and content nothing keeps."""
    home = tmp_path / "home"
    store = EmbeddedStore(home)
    rng = np.random.default_rng(0)
    manifest, built = build_dataset(store, "tiny", rng.normal(size=(64, 4)).astype(np.float32),
                                    rng.integers(0, 3, 64).astype(np.int64), 2, 0.25, 0)
    task = load_task(TASK_TEMPLATE.format(manifest=manifest, steps=10, checkpoint=5, density=1.0, peers=2))
    task_cid = store.add_bytes(task_bytes(task))
    model, optim, initial = (store.add_bytes(noise(300_000, s)) for s in (2, 3, 4))
    key = create_new_key_pair()
    record = proven_record(ModelRecord(task_cid=task_cid, version=1, parent=initial, round=0, step=5,
                                       members=(), metrics={}, model_cid=model, optimizer_cid=optim,
                                       term=1, coordinator=""), key, [key])
    chain = entry_bytes(ConfirmedRecord(signed=record, attestations=())) + b"\n"
    chain_cid = store.add_bytes(chain)
    run_dir = home / "tasks" / task_cid
    run_dir.mkdir(parents=True)
    (run_dir / "chain.jsonl").write_bytes(chain)

    pinned = store.add_bytes(noise(400_000, 5))
    store.pin_add(pinned)
    direct = store.add_bytes(b"one block, pinned directly")
    store.pin_add(direct, recursive=False)
    unpinned = store.add_bytes(noise(500_000, 6))

    shards = [ref.cid for refs in built.splits.values() for ref in refs]
    kept = {name: blocks_of(store, cid) for name, cid in [
        ("task", task_cid), ("manifest", manifest), ("model", model), ("optimizer", optim),
        ("chain", chain_cid), ("pinned", pinned), ("direct", direct),
    ] + [(f"shard{i}", c) for i, c in enumerate(shards)]}
    gone = blocks_of(store, unpinned) | blocks_of(store, initial)
    an_hour_ago = time.time() - 3600  # stored a while ago: gc spares blocks written as it starts
    for path in store.blocks.block_files():
        os.utime(path, (an_hour_ago, an_hour_ago))
    return store, kept, gone


def test_gc_keeps_pins_and_run_state_and_removes_the_rest(tmp_path):
    store, kept, gone = _task_home(tmp_path)
    before = held(store)
    every_kept = set().union(*kept.values())
    assert gone and not gone & every_kept and before == every_kept | gone

    dry = repo("gc", "--dry-run", "--json", home=store.home)
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["removed"] == len(gone)
    assert held(store) == before

    done = repo("gc", home=store.home)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"gc: removed {len(gone)} blocks")
    assert "1 tasks" in done.stdout and "2 pins" in done.stdout
    assert "gc: " in done.stderr  # progress
    assert held(store) == every_kept
    assert repo("verify", home=store.home).returncode == 0
    again = repo("gc", "--json", home=store.home)
    assert json.loads(again.stdout)["removed"] == 0


def test_gc_keeps_the_stage_files_a_pipelined_runs_manifest_names(tmp_path):
    """A pipelined record's model CID names a stage manifest (JSON: no DAG links to its files), so
    the stage files it names are kept as the checkpoint itself is (the member's own stage and the
    copy it keeps of the next); a stage whose files this home never held is no obstacle."""
    from p2ptrain.training import manifest_bytes, StageFile

    store, kept, gone = _task_home(tmp_path)
    task = load_task(TASK_TEMPLATE.format(manifest=_manifest_of(store), steps=10, checkpoint=5,
                                          density=1.0, peers=2).replace('name = "', 'name = "staged-', 1))
    task_cid = store.add_bytes(task_bytes(task))
    held_files = [store.add_bytes(noise(300_000, seed)) for seed in (7, 8)]
    absent = [cid_str(make_cid(b"never held " + bytes([i]))) for i in range(2)]
    manifest = store.add_bytes(manifest_bytes([
        StageFile(first=0, last=1, model=held_files[0], optimizer=held_files[1], parameters=10),
        StageFile(first=2, last=3, model=absent[0], optimizer=absent[1], parameters=10),
    ]))
    key = create_new_key_pair()
    record = proven_record(ModelRecord(task_cid=task_cid, version=1, parent=absent[0], round=0, step=5,
                                       members=(), metrics={}, model_cid=manifest, optimizer_cid=manifest,
                                       term=1, coordinator=""), key, [key])
    run_dir = store.home / "tasks" / task_cid
    run_dir.mkdir(parents=True)
    (run_dir / "chain.jsonl").write_bytes(entry_bytes(ConfirmedRecord(signed=record, attestations=())) + b"\n")
    stage_blocks = set().union(*(blocks_of(store, cid) for cid in [manifest, *held_files]))
    an_hour_ago = time.time() - 3600
    for path in store.blocks.block_files():
        os.utime(path, (an_hour_ago, an_hour_ago))

    done = repo("gc", home=store.home)
    assert done.returncode == 0, done.stderr
    assert stage_blocks <= held(store)
    assert not gone & held(store)
    assert repo("verify", home=store.home).returncode == 0


def _manifest_of(store: EmbeddedStore) -> str:
    """The dataset manifest of the one task _task_home made."""
    from p2ptrain.task import MAX_TASK_BYTES, read_task

    (task_dir,) = (store.home / "tasks").iterdir()
    return read_task(store.cat(task_dir.name, max_bytes=MAX_TASK_BYTES + 1)).dataset.manifest


def test_gc_removes_nothing_when_a_tasks_state_cannot_be_read(tmp_path):
    store, _, _ = _task_home(tmp_path)
    before = held(store)
    chain = next((store.home / "tasks").iterdir()) / "chain.jsonl"
    chain.write_bytes(b'{"record": ' * 10_000 + b"\n")
    result = repo("gc", home=store.home)
    assert result.returncode == 1
    assert "cannot tell what task" in result.stderr and "Traceback" not in result.stderr
    assert held(store) == before


def test_sweep_keeps_a_block_written_after_the_collection_began(tmp_path):
    blocks = BlockStore(tmp_path / "blocks")
    old, new = b"old unreferenced", b"new unreferenced"
    blocks.put(make_cid(old), old)
    os.utime(next(iter(blocks.block_files())), (time.time() - 60, time.time() - 60))
    began = time.time()
    blocks.put(make_cid(new), new)
    sweep = blocks.sweep(keep=set(), written_before=began)
    assert sweep.removed_cids == [cid_str(make_cid(old))]
    assert blocks.has(make_cid(new)) and not blocks.has(make_cid(old))


def test_gc_refuses_while_a_node_runs(tmp_path):
    from p2ptrain.testing import node_processes

    with node_processes(1, tmp_path) as (node,):
        store = EmbeddedStore(node.home)
        cid = store.add_bytes(b"not pinned")
        result = repo("gc", home=node.home)
        assert result.returncode == 1
        assert "a node is running" in result.stderr
        assert store.has(cid)


@pytest.mark.parametrize("command", ["verify", "gc"])
def test_help_explains(command):
    result = run_forked([P2PTRAIN, "repo", command, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert ("hash" in result.stdout) if command == "verify" else ("pin" in result.stdout and "node" in result.stdout)


def test_ipfs_add_pins_as_kubo_does_so_gc_keeps_it(tmp_path):
    home = tmp_path / "home"
    kept_file, loose_file = tmp_path / "kept", tmp_path / "loose"
    kept_file.write_bytes(noise(300_000, 7))
    loose_file.write_bytes(noise(300_000, 8))
    add = lambda *a: run_forked([P2PTRAIN, "ipfs", "add", *a, "--home", str(home)],  # noqa: E731
                                capture_output=True, text=True, timeout=60)
    kept = add(str(kept_file)).stdout.strip()
    loose = add("--no-pin", str(loose_file)).stdout.strip()
    store = EmbeddedStore(home)
    assert store.pin_ls() == {kept: "recursive"}
    for path in store.blocks.block_files():
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    assert repo("gc", home=home).returncode == 0
    assert store.cat(kept) == kept_file.read_bytes()
    assert not store.has(loose)
