"""IPFSDataset with real stores and a real DataLoader (worker processes included)."""

import threading

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from p2ptrain.data import IPFSDataset, build_dataset
from p2ptrain.data._ipfs_dataset import ShardUnavailable
from p2ptrain.ipfs import EmbeddedStore, parse_cid

N = 600
SHARDS = 6


@pytest.fixture
def published(tmp_path):
    """A dataset whose sample i has features [i, -i] and label i, in a source store."""
    store = EmbeddedStore(tmp_path / "source")
    ids = np.arange(N)
    features = np.stack([ids, -ids], axis=1).astype(np.float32)
    cid, manifest = build_dataset(store, "ids", features, ids, SHARDS, test_fraction=0)
    return store, cid, manifest


def labels_of(dataset, **loader):
    batches = list(DataLoader(dataset, batch_size=16, **loader))
    for x, y in batches:
        assert torch.equal(x[:, 0].long(), y) and torch.equal(x[:, 1].long(), -y)
    return torch.cat([y for _, y in batches]).tolist()


def test_two_workers_see_every_sample_once_per_epoch_in_a_new_order(published):
    store, cid, _ = published
    dataset = IPFSDataset(cid, store=store, seed=7)
    assert len(dataset) == N
    orders = []
    for epoch in (0, 1, 0):
        dataset.set_epoch(epoch)
        seen = labels_of(dataset, num_workers=2)
        assert sorted(seen) == list(range(N))
        orders.append(seen)
    assert orders[0] != orders[1]  # reshuffled
    assert orders[0] == orders[2]  # and reproducible from seed + epoch
    assert orders[0] != labels_of(IPFSDataset(cid, store=store, seed=8), num_workers=2)


def test_no_shuffle_keeps_manifest_order(published):
    store, cid, _ = published
    seen = labels_of(IPFSDataset(cid, store=store, shuffle=False))
    assert len(seen) == N and seen != sorted(seen)  # the builder's seeded split, shard by shard
    assert seen == labels_of(IPFSDataset(cid, store=store, shuffle=False))


def test_ranks_partition_the_shards(published):
    store, cid, _ = published
    parts = [set(labels_of(IPFSDataset(cid, store=store, rank=r, world_size=4))) for r in range(4)]
    assert sum(len(p) for p in parts) == N
    assert set().union(*parts) == set(range(N))


def test_shard_ids_select_shards(published):
    store, cid, manifest = published
    dataset = IPFSDataset(cid, store=store, shard_ids=[1, 4])
    shards = manifest.shards("train")
    assert len(labels_of(dataset)) == len(dataset) == shards[1].num_samples + shards[4].num_samples
    with pytest.raises(ValueError, match="distinct indices"):
        IPFSDataset(cid, store=store, shard_ids=[6])
    with pytest.raises(ValueError, match="together"):
        IPFSDataset(cid, store=store, rank=0)


def test_only_needed_shards_are_fetched_and_then_cached(published, tmp_path):
    source, cid, manifest = published
    fetched = []

    def fetch(c):
        fetched.append(c)
        return source.blocks.get(c)

    sink = EmbeddedStore(tmp_path / "sink", fetch_block=fetch)
    dataset = IPFSDataset(cid, store=sink, rank=1, world_size=2)
    labels_of(dataset, num_workers=2)
    held = [sink.has(shard.cid) for shard in manifest.shards("train")]
    assert held == [i % 2 == 1 for i in range(SHARDS)]
    before = len(fetched)
    labels_of(dataset)  # second epoch: all local
    assert len(fetched) == before


def test_next_shard_is_prefetched_while_the_current_one_is_read(published, tmp_path):
    source, cid, manifest = published
    wanted = {parse_cid(s.cid) for s in manifest.shards("train")}
    asked = set()
    second_asked = threading.Event()

    def fetch(c):
        if c in wanted:
            asked.add(c)
            if len(asked) == 2:
                second_asked.set()
        return source.blocks.get(c)

    sink = EmbeddedStore(tmp_path / "sink", fetch_block=fetch)
    samples = iter(IPFSDataset(cid, store=sink))
    next(samples)  # one sample of the first shard consumed, nothing more asked of the iterator
    assert second_asked.wait(10)
    samples.close()


def test_missing_shard_is_a_clear_error(published, tmp_path):
    source, cid, manifest = published
    gone = manifest.shards("train")[3].cid
    source.blocks.delete(gone)
    dataset = IPFSDataset(cid, store=source, shuffle=False)
    with pytest.raises(ShardUnavailable, match=f"shard 3 of split 'train' \\({gone}\\).*not held"):
        labels_of(dataset, num_workers=2)


def test_default_home_comes_from_the_environment(published, monkeypatch):
    source, cid, _ = published
    monkeypatch.setenv("P2PTRAIN_HOME", str(source.home))
    assert len(IPFSDataset(cid)) == N
