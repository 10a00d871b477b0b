"""Where one run keeps its files on a node's home: ``<home>/tasks/<task CID>/``.

The run itself, the task service, the head answers, ``repo gc``, the latest finder, ``model
serve``, ``model verify`` and ``task report`` all read or write these files; they name them through
:class:`RunDir` so that the layout is written once, and a file that moves moves here.

A run's folder is named by its task CID, which arrives from the network: :meth:`RunDir.of` parses
it as a CID first, so no name a peer sends can point a path outside ``<home>/tasks``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import logging

from p2ptrain.ipfs import InvalidCID, parse_cid

# The protocol (records, their signatures) is imported where a chain is read: it imports torch and
# libp2p (4 s of CPU here), which a command that only names or lists runs (``repo gc`` on a home
# that ran none) need not pay.
if TYPE_CHECKING:
    from p2ptrain.wire import ConfirmedRecord

logger = logging.getLogger(__name__)

TASKS_DIR = "tasks"
# The run's confirmed chain (run/_chain_file.py), only ever extended.
CHAIN_FILE = "chain.jsonl"
# The publisher's cancel, kept so that this home never runs the task again (a restart with --join,
# an announcement) and, on the publisher's node, so that it tells joiners.
CANCELLED_FILE = "cancelled"
# On the publisher's node: it sent the cancel, and repeats it to whoever asks for the task's head
# (a joiner), since only its key can sign one.
CANCEL_SENT_FILE = "cancel_sent"
# The latest term this member may have voted in (run/_ballots_file.py).
VOTED_FILE = "voted_through"
# Chains a search by model CID reads at most (a home that took part in more runs searches the first).
MAX_CHAINS_SEARCHED = 256
# This member's error feedback at a checkpoint (run/_feedback_file.py): ``feedback-<step>.safetensors``.
_FEEDBACK = re.compile(r"feedback-([0-9]{1,12})\.safetensors")


@dataclass(frozen=True)
class RunDir:
    """The folder of one run (which need not exist yet) and the paths of its files."""

    path: Path

    @classmethod
    def of(cls, home: Path, task_cid: str) -> RunDir:
        """The folder of ``task_cid``'s run under ``home``; :class:`~p2ptrain.ipfs.InvalidCID` for a
        name that is not a CID."""
        parse_cid(task_cid)
        return cls(Path(home) / TASKS_DIR / task_cid)

    @classmethod
    def runs(cls, home: Path) -> list[RunDir]:
        """Every run folder under ``home``, by task CID (entries not named by a CID are not runs)."""
        tasks = Path(home) / TASKS_DIR
        if not tasks.is_dir():
            return []
        found = []
        for entry in sorted(tasks.iterdir()):
            try:
                parse_cid(entry.name)
            except InvalidCID:
                continue
            found.append(cls(entry))
        return found

    @property
    def task_cid(self) -> str:
        return self.path.name

    @property
    def chain(self) -> Path:
        return self.path / CHAIN_FILE

    @property
    def cancelled(self) -> Path:
        return self.path / CANCELLED_FILE

    @property
    def cancel_sent(self) -> Path:
        return self.path / CANCEL_SENT_FILE

    @property
    def voted(self) -> Path:
        return self.path / VOTED_FILE

    def feedback(self, step: int) -> Path:
        return self.path / f"feedback-{step}.safetensors"

    def feedback_steps(self) -> list[int]:
        """The steps whose feedback file the folder holds, in order."""
        return sorted(int(m.group(1)) for p in self.path.iterdir() if (m := _FEEDBACK.fullmatch(p.name)))

    def read_chain(self) -> bytes | None:
        """The chain file's bytes, None when there is none; a :class:`~p2ptrain.protocol.RecordError`
        when it is over :data:`~p2ptrain.protocol.MAX_CHAIN_BYTES` (a reader never holds more)."""
        from p2ptrain.protocol import MAX_CHAIN_BYTES, RecordError  # here: see the note at the imports

        try:
            with open(self.chain, "rb") as f:
                data = f.read(MAX_CHAIN_BYTES + 1)
        except FileNotFoundError:
            return None
        if len(data) > MAX_CHAIN_BYTES:
            raise RecordError(f"{self.chain} is over {MAX_CHAIN_BYTES} bytes")
        return data


def record_naming(home: Path, model_cid: str) -> ConfirmedRecord | None:
    """The confirmed record of ``model_cid`` in the chains ``home`` keeps (its signature checked),
    None if none names it: which task and version a model is, for ``model serve`` and ``model
    verify`` given a bare model CID. A chain that cannot be read is logged and passed over."""
    from p2ptrain.protocol import RecordError, chain_lines, entry_from_bytes  # here: see the note at the imports

    held = [run for run in RunDir.runs(home) if run.chain.is_file()]
    for run in held[:MAX_CHAINS_SEARCHED]:
        try:
            data = run.read_chain()
            for line in chain_lines(data or b""):
                entry = entry_from_bytes(line)
                if entry.signed.record.model_cid == model_cid:
                    return entry
        except (OSError, RecordError) as exc:
            logger.warning("%s: not read (%s)", run.chain, exc)
    return None
