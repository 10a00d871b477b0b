"""The latest term this member may have voted in, kept in ``<home>/tasks/<task CID>/voted_through``.

One vote per member per term is half of why a term elects at most one coordinator
(protocol/_election.py). An election keeps its ballots in memory, so a member restarted within a
term it had voted in voted in it again, maybe for another candidate, and that term could elect two
coordinators (about 1 random run in 200 of the election's tests did). So, as Raft keeps its vote,
the node writes :attr:`~p2ptrain.protocol.Election.voted_through` here after each tick or
message of the election and before it publishes what that returned, and the run's election starts
from it again (a restart of the member, or of the whole run from its chain: the file lives in the
run's folder beside ``chain.jsonl``, and nothing removes it).
"""

from __future__ import annotations

import logging
import re
from p2ptrain.base import write_atomic
from p2ptrain.run._run_dir import RunDir

logger = logging.getLogger(__name__)

# A term as written (a decimal int of at most 19 digits: terms fit the wire's 64-bit ints), or -1.
_TERM = re.compile(rb"(-1|[0-9]{1,19})\n?")
_MAX_BYTES = 21


def save_voted_through(run_dir: RunDir, term: int) -> None:
    """Keep ``term`` as the latest this member may have voted in (atomically: a crash leaves the
    old number or the new one)."""
    run_dir.path.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir.voted, str(term).encode(), mode=0o600)


def load_voted_through(run_dir: RunDir) -> int | None:
    """The term kept by :func:`save_voted_through`; -1 when there is none (this home never voted
    in the run). None when the file holds no term (only a hand or a broken disk writes that): this
    member cannot tell where it voted, so it votes in no term while it runs; the file is kept as
    it is, and logged, for its owner to look at."""
    path = run_dir.voted
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_BYTES + 1)
    except FileNotFoundError:
        return -1
    except OSError as exc:
        logger.warning("%s: unreadable (%s); this member votes in no term of the run until it can be read",
                       path, exc.strerror or exc)
        return None
    match = _TERM.fullmatch(data)
    if match is None or int(match.group(1)) >= 2**63:
        logger.warning("%s holds no term number (%r); this member votes in no term of the run "
                       "(remove the file to let it vote again)", path, data[:_MAX_BYTES])
        return None
    return int(match.group(1))
