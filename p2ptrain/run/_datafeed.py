"""A member's data for a run: its training shards for its place in the ring, the test split, and
a copy of every shard so that the data outlives the peer that published it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
import trio

from p2ptrain.data import IPFSDataset
from p2ptrain.ipfs import ContentUnavailable
from p2ptrain.run._run_state import RunState
from p2ptrain.training import PositionedBatches, StateSnapshot, batched

logger = logging.getLogger(__name__)

# Replication starts once this member's own shards are in (they go first, so its first round does
# not wait behind the whole dataset), or after this long when no plan has given it shards yet (a
# joiner still resyncing, a peer left out of the ring): then all shards are worth holding anyway.
REPLICATE_DEADLINE_S = 10.0


class DataFeed:
    """Batches for this member's rank, the coordinator's evaluation, and shard replication."""

    def __init__(self, run: RunState) -> None:
        self.run = run
        self._batches: tuple[tuple[int, int], PositionedBatches] | None = None
        self._own_shards_held = trio.Event()

    async def training_batches(self, rank: int, world: int, position: int) -> Iterator[Any]:
        """This member's batches for its place in the ring, from batch ``position`` of that stream
        (the trainer's ``batch_position``: a function of its step); shards are fetched (only these)
        first. The stream in use is kept while it is at that position already."""
        held = self._batches
        if held is not None and held[0] == (rank, world) and held[1].position == position:
            return held[1]
        run = self.run
        if run.task.model.user:
            return iter(())  # the user's loop reads its own data (training/_user_trainer.py)
        assert run.manifest is not None and run.task.dataset is not None
        split = run.task.dataset.train_split
        shards = run.manifest.shards(split)
        # More members than shards: positions share shards (each in its own order, seeded by its
        # rank) rather than one member holding none.
        shard_rank, shard_world = (rank, world) if world <= len(shards) else (rank % len(shards), len(shards))
        for index in range(shard_rank, len(shards), shard_world):
            await run.content.fetch(shards[index].cid)
        dataset = IPFSDataset(
            run.task.dataset.manifest, split=split, rank=shard_rank, world_size=shard_world,
            store=run.content.store, seed=run.task.seed + rank,
        )
        self._own_shards_held.set()
        batches = PositionedBatches(dataset, run.task.training.batch_size, position)
        self._batches = ((rank, world), batches)
        logger.info("%s: training on shards %s of %d (rank %d of %d) from batch %d", run.log_prefix,
                    list(range(shard_rank, len(shards), shard_world)), len(shards), rank, world, position)
        return batches

    async def fetch_test_split(self) -> None:
        """Every shard of the test split, for the coordinator's evaluation (ContentUnavailable if not)."""
        run = self.run
        if run.task.dataset is None:
            return  # the members' own data: each evaluates (or not) on its own
        assert run.manifest is not None
        for ref in run.manifest.shards(run.task.dataset.test_split):
            await run.content.fetch(ref.cid)

    def evaluate(self, snapshot: StateSnapshot | None = None) -> dict[str, float]:
        """Loss and accuracy of the current weights (or of ``snapshot``'s) on the task's test split
        (coordinator only)."""
        run = self.run
        trainer, _ = run.require()
        if run.task.dataset is None:
            return trainer.evaluate_own()
        batches = self.test_batches()
        metrics = trainer.evaluate(batches) if snapshot is None else trainer.evaluate_snapshot(snapshot, batches)
        return {"accuracy": metrics.accuracy, "loss": metrics.loss}

    def test_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The task's test split (fetched: :meth:`fetch_test_split`) in evaluation batches, in order."""
        run = self.run
        assert run.task.dataset is not None
        split = run.task.dataset.test_split
        dataset = IPFSDataset(run.task.dataset.manifest, split=split, store=run.content.store, shuffle=False)
        return batched(dataset, run.task.training.eval_batch_size)

    async def replicate(self) -> None:
        """Hold every shard (training, then test), after our own: if the peer that published the
        dataset dies, whichever shards a new ring assigns us, and the test split a new coordinator
        evaluates on, can still be had from the other members."""
        run = self.run
        dataset = run.task.dataset
        if dataset is None:
            return  # nothing shared to replicate: each member's data is its own
        assert run.manifest is not None
        with trio.move_on_after(REPLICATE_DEADLINE_S):
            await self._own_shards_held.wait()
        test = run.manifest.shards(dataset.test_split) if dataset.test_split in run.manifest.splits else ()
        refs = (*run.manifest.shards(dataset.train_split), *test)
        held = 0
        for ref in refs:
            try:
                await run.content.fetch(ref.cid)
                held += 1
            except ContentUnavailable as exc:
                logger.debug("%s: could not replicate shard %s yet: %s", run.log_prefix, ref.cid, exc)
        logger.info("%s: holds %d of the data set's %d shards (each fetch is logged at DEBUG)", run.log_prefix,
                    held, len(refs))
