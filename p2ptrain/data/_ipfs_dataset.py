"""``IPFSDataset``: a PyTorch iterable dataset that streams verified shards by CID.

Each reader (rank × DataLoader worker) gets a disjoint set of shards and fetches only those, through the
content store, which verifies every block and keeps it, so the second epoch reads from local disk. While
one shard is consumed the next, if it is not local yet, is fetched in a background thread. Order is a
pure function of ``(seed, epoch)``: every worker computes the same shard permutation and takes its own
slice, so with ``set_epoch`` each epoch sees every sample of the selection exactly once, in a new order.
A manifest made with ``dataset add --standardize`` has its features standardized here, and an image
dataset's uint8 pixels are scaled (``pixels``), so training and ``model eval`` see the same inputs.
Labels that name classes and token ids are checked against the manifest's class count and vocabulary
(a shard from the network with label 7 of 5 classes, or token 60,000 of 50,000, would otherwise stop
a training step with an index error).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from p2ptrain.data._manifest import Manifest, ShardRef
from p2ptrain.data._shards import ShardError, decode_shard
from p2ptrain.data._standardize import apply as standardize, apply_pixels
from p2ptrain.base import UserError, default_home
from p2ptrain.ipfs import BlockMismatch, ContentStore, ContentUnavailable, DagError, open_store


class ShardUnavailable(UserError, RuntimeError):
    """A shard the dataset needs cannot be had, or is not what the manifest promises (one line in the CLI)."""

    def __init__(self, message: str, cid: str | None = None) -> None:
        # One-message constructor: DataLoader rebuilds a worker's exception as ``type(exc)(message)``.
        super().__init__(message)
        self.cid = cid


class IPFSDataset(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples ``(features, label)`` of one split of the dataset whose manifest is ``manifest_cid``.

    Choose shards with ``shard_ids`` (indices into the split), or with ``rank``/``world_size``
    (shard ``i`` goes to rank ``i % world_size``), or neither for all. Give a ``store``, or a ``home``
    for the embedded store of that node home (default: ``$P2PTRAIN_HOME`` or ``~/.p2ptrain``). With
    ``DataLoader(num_workers=k)`` the selection is
    split again across workers; call :meth:`set_epoch` before each epoch (without persistent workers)
    to reshuffle.
    """

    def __init__(
        self,
        manifest_cid: str,
        split: str = "train",
        shard_ids: Sequence[int] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        store: ContentStore | None = None,
        home: Path | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        if store is None:
            if home is None:
                home = default_home()
            store = open_store(Path(home).expanduser())
        self.store = store
        self.manifest_cid = manifest_cid
        try:
            self.manifest = Manifest.load(store, manifest_cid)
        except ContentUnavailable as exc:  # a machine that did not add the data set: say how it gets it
            raise ContentUnavailable(exc.cid, f"{exc.reason}; fetch the data set first: p2ptrain dataset get "
                                     f"{manifest_cid} --bootstrap MULTIADDR") from None
        self.split = split
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.shard_ids = self._select(len(self.manifest.shards(split)), shard_ids, rank, world_size)

    @staticmethod
    def _select(
        count: int, shard_ids: Sequence[int] | None, rank: int | None, world_size: int | None
    ) -> list[int]:
        if (rank is None) != (world_size is None):
            raise ValueError("give rank and world_size together")
        if shard_ids is not None and rank is not None:
            raise ValueError("give shard_ids or rank/world_size, not both")
        if shard_ids is not None:
            ids = list(shard_ids)
            bad = [i for i in ids if not 0 <= i < count]
            if bad or len(set(ids)) != len(ids):
                raise ValueError(f"shard_ids must be distinct indices in [0, {count}): {ids}")
            return ids
        if rank is not None:
            if world_size is None or not 0 <= rank < world_size:
                raise ValueError(f"rank {rank} is outside world_size {world_size}")
            return list(range(rank, count, world_size))
        return list(range(count))

    @property
    def shard_count(self) -> int:
        """Shards in the split (all of them, not only this selection's)."""
        return len(self.manifest.shards(self.split))

    def select(self, *, shard_ids: Sequence[int] | None = None, rank: int | None = None,
               world_size: int | None = None) -> None:
        """Choose the shards again, as the constructor does (``p2ptrain.train`` shards a shared
        dataset once it knows the run's members)."""
        self.shard_ids = self._select(self.shard_count, shard_ids, rank, world_size)

    def set_epoch(self, epoch: int) -> None:
        """Pick the epoch whose order the next iteration uses (same seed + epoch = same order)."""
        self.epoch = epoch

    def __len__(self) -> int:
        """Samples in this selection (all workers together)."""
        shards = self.manifest.shards(self.split)
        return sum(shards[i].num_samples for i in self.shard_ids)

    def _my_shards(self) -> list[int]:
        ids = list(self.shard_ids)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch])
            ids = [ids[i] for i in rng.permutation(len(ids))]
        worker = get_worker_info()
        if worker is not None:
            ids = ids[worker.id :: worker.num_workers]
        return ids

    def load_shard(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fetch (or read from cache), verify and decode shard ``index`` of the split; standardize its
        features, or scale its pixels, when the manifest says so (as float32)."""
        features, labels = self._read(index)
        return torch.from_numpy(self._scaled(features)), torch.from_numpy(labels)

    def _read(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Shard ``index`` as stored (pixels still uint8: shuffling them moves a quarter of the bytes)."""
        ref: ShardRef = self.manifest.shards(self.split)[index]
        try:
            data = self.store.cat(ref.cid)
            features, labels = decode_shard(
                data, self.manifest.features, self.manifest.labels, ref.num_samples
            )
            self._check_ranges(features, labels)
        except (ContentUnavailable, BlockMismatch, DagError, ShardError) as exc:
            reason = exc.reason if isinstance(exc, ContentUnavailable) else str(exc)
            if isinstance(exc, ContentUnavailable):
                reason += f"; fetch the data set first: p2ptrain dataset get {self.manifest_cid} --bootstrap MULTIADDR"
            raise ShardUnavailable(
                f"shard {index} of split {self.split!r} ({ref.cid}) cannot be used: {reason}", ref.cid
            ) from exc
        return features, labels

    def _scaled(self, features: np.ndarray) -> np.ndarray:
        if self.manifest.standardize is not None:
            return standardize(features, self.manifest.standardize)
        if self.manifest.pixels is not None:
            return apply_pixels(features, self.manifest.pixels)
        return features

    def _check_ranges(self, features: np.ndarray, labels: np.ndarray) -> None:
        """Labels below the class count, token ids below the vocabulary (ShardError if not)."""
        limits = []
        if self.manifest.classes is not None:
            limits.append(("labels", labels, len(self.manifest.classes)))
        if self.manifest.tokens is not None:
            limits += [("features", features, self.manifest.tokens.vocab_size),
                       ("labels", labels, self.manifest.tokens.vocab_size)]
        for key, array, limit in limits:
            if array.size and (int(array.min()) < 0 or int(array.max()) >= limit):
                raise ShardError(f"{key} hold values outside [0, {limit}) that the manifest allows")

    def tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` that made this dataset's token ids (from the store, or the
        network, by the CID the manifest names; bounded), or ``None`` when the ids are bytes or the
        dataset is not text. Needs ``pip install 'p2ptrain[data]'``."""
        tokens = self.manifest.tokens
        if tokens is None or tokens.tokenizer is None:
            return None
        from p2ptrain.data._tokens import tokenizer_by_cid

        return tokenizer_by_cid(self.store, tokens.tokenizer)

    def _prefetch(self, pool: ThreadPoolExecutor, index: int) -> Future[tuple[np.ndarray, np.ndarray]] | None:
        """Start fetching shard ``index`` in the background, unless it is already local.

        A local shard is read when its turn comes: reading it in the thread would only make the two
        threads trade the GIL (the reader releases it for every block read and hash, and waits up to
        the 5 ms switch interval to get it back from this busy thread each time).
        """
        if self.store.has(self.manifest.shards(self.split)[index].cid):
            return None
        return pool.submit(self._read, index)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        ids = self._my_shards()
        if not ids:
            return
        with ThreadPoolExecutor(1, thread_name_prefix="ipfs-prefetch") as prefetch:
            pending = self._prefetch(prefetch, ids[0])
            for k, index in enumerate(ids):
                features, labels = pending.result() if pending else self._read(index)
                pending = self._prefetch(prefetch, ids[k + 1]) if k + 1 < len(ids) else None
                if self.shuffle:
                    order = np.random.default_rng([self.seed, self.epoch, index]).permutation(len(labels))
                    features, labels = features[order], labels[order]
                yield from zip(torch.from_numpy(self._scaled(features)).unbind(0), torch.from_numpy(labels).unbind(0))
