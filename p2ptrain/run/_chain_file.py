"""A run's confirmed chain on disk, ``<home>/tasks/<task CID>/chain.jsonl``: read when the run
starts, only ever extended.

The file is the history a member resumes from after a stop (its own, or the whole run's), and what
its node answers head requests with once the run is over (services/_head_answers.py). So a record in
it is never removed or rewritten: a chain is written here only when it extends the file's, by
appending the lines of the records it adds (the whole file written atomically, so a reader sees
the old file or the new one). A chain that conflicts with the file (a fork) is refused with a
:class:`~p2ptrain.protocol.RecordError` and the file is kept as it was. Every chain that
reaches the file goes through :meth:`ChainFile.extend`; the file is read through :meth:`ChainFile.open`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from p2ptrain.base import write_atomic
from p2ptrain.protocol import Chain, ChainRules, RecordError
from p2ptrain.run._run_dir import RunDir

logger = logging.getLogger(__name__)


class ChainFile:
    """The chain a run keeps on disk: :attr:`chain` is what the file holds, verified."""

    def __init__(self, path: Path, chain: Chain, data: bytes) -> None:
        self.path = path
        self.chain = chain
        self._data = data  # the file's bytes: appended to, never rewritten

    @classmethod
    def open(cls, run_dir: RunDir, task_cid: str, initial_cid: str, rules: ChainRules | None = None) -> ChainFile:
        """The run's chain file, read and re-verified under the task's ``rules`` (an empty chain when
        there is none yet).

        A file that does not verify (a record that is not signed, does not follow the one before it,
        starts from another model, lacks its proof) is refused with a :class:`RecordError` naming the
        file; it is left as it was, for its owner to look at.
        """
        path = run_dir.chain
        try:
            data = run_dir.read_chain()
            if data is None:
                return cls(path, Chain(task_cid, initial_cid, rules), b"")
            chain = Chain.from_bytes(task_cid, initial_cid, data, rules)
        except RecordError as exc:
            raise RecordError(f"{path}: {exc}; the file is kept as it was (move it away to start this "
                              "member afresh)") from None
        return cls(path, chain, data)

    def copy(self) -> Chain:
        """A chain of the file's records, verified when the file was read, for the run to extend
        (the file's own stays what the file holds)."""
        chain = Chain(self.chain.task_cid, self.chain.initial_cid, self.chain.rules)
        chain.records = list(self.chain.records)
        chain.proofs = list(self.chain.proofs)
        return chain

    def extend(self, chain: Chain) -> int:
        """Append the records ``chain`` adds to the file's (how many); nothing when it adds none.

        ``chain`` must hold every record of the file unchanged: a different record at a version the
        file holds is a fork, refused with a :class:`RecordError` and logged, the file kept as it was.
        """
        try:
            added = self.chain.extension(chain)
        except RecordError as exc:
            logger.warning("%s: refused a chain of v%d that does not extend the file's v%d: %s", self.path,
                           chain.version, self.chain.version, exc)
            raise
        if not added:
            return 0
        # Only the added lines are serialized (the file holds the others): the whole chain at
        # every confirmed record made a long run's saves quadratic.
        data = self._data + chain.to_bytes(since=self.chain.version)
        write_atomic(self.path, data, mode=0o600)
        for signed, proof in zip(added, chain.proofs[self.chain.version :]):
            self.chain.append(signed, proof)
        self._data = data
        return len(added)
