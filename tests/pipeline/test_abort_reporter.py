"""A plan member that says it takes no part in a pipelined step and then joins its summary anyway
(red team h-attack5, item 2; protocol/_step_aborts.py, protocol/_failure_reports.py): four full
peers (``local_peers``), the pipelined task of test_pipelined_run.py.

The reporter runs the project's own code but for one thing: as its own summary's round opens (every
member joined, as it sees it: the latest moment a report still ends a step anywhere), it publishes a
signed ``RoundFailed`` saying it cannot follow the plan, and goes on in the summary. A member whose
round had not opened yet leaves the step naming it; where every member's had (what the runs here
showed), the step completed everywhere, and on main the coordinator still took it as a failure:
the run stopped for good (2 of 3 runs: at step 4, the retry from the reported step behind the
coordinator by more than a step, never planned), or redid the step with a retry plan of the same
four members, the reporter never left out. Now the report of a step that completed
here with the reporter in it is refuted (counted as ``failure_report``) and its sender left out of
the next plans for the quarantine. Checked: a later checkpoint, the same record at every honest
member, of a span without the reporter; on main every plan had it.
"""

from __future__ import annotations

from pathlib import Path

import trio

from p2ptrain.protocol import CANNOT_FOLLOW
from p2ptrain.run._spans import Spans
from p2ptrain.run._step_window import StepWindow
from p2ptrain.testing import local_peers
from p2ptrain.wire import RoundFailed

from .test_pipelined_run import publish, small_text, TASK  # noqa: F401 (small_text: an autouse fixture)

# peers.max 4: the run's members, all from its start (term 0 and the first plan need not wait for more)
FOUR = TASK.replace("max = 8", "max = 4")
assert FOUR != TASK

DEADLINE_S = 300.0
STEP_S = 120.0
ATTACKS = 3  # steps the reporter says it cannot follow as its summary opens, at most
BLAMED: list[tuple[str, str]] = []  # (member, the culprit its failed step named)
REPORTED: list[int] = []  # rounds the reporter said it takes no part in


async def test_a_reporter_that_joins_the_summary_anyway_splits_no_step(tmp_path: Path, monkeypatch) -> None:
    BLAMED.clear()
    REPORTED.clear()
    reporter: list[str] = []
    failed_here, joined = Spans._failed_here, StepWindow.joined

    def noting(self: Spans, exc):  # every member's view of whom its failed step named
        gone = failed_here(self, exc)
        peer = getattr(exc, "peer_id", None)
        if peer is not None and peer != self.run.node.peer_id:
            BLAMED.append((self.run.me, peer.to_base58()))
        return gone

    async with trio.open_nursery() as nursery:

        def reporting(self: StepWindow) -> None:
            key, open_round = self._aborts._plan, self._aborts._open
            if reporter and self.run.me == reporter[0] and key is not None and open_round is not None \
                    and len(REPORTED) < ATTACKS and open_round not in REPORTED:
                task, term, _, attempt = key
                REPORTED.append(open_round)
                report = RoundFailed(task_cid=task, term=term, round=open_round, attempt=attempt,
                                     step=self.run.require()[0].step, reason=f"{CANNOT_FOLLOW}: (it can)")
                nursery.start_soon(self.run.broadcast, report)
            joined(self)

        monkeypatch.setattr(Spans, "_failed_here", noting)
        monkeypatch.setattr(StepWindow, "joined", reporting)
        with trio.fail_after(DEADLINE_S):
            async with local_peers(4, tmp_path) as peers:
                _, task_cid = await publish(peers, FOUR)
                runs = await peers.join_all(task_cid)
                watcher = runs[0]

                def four():
                    plan = watcher.book.last_plan if watcher.book else None
                    return plan if plan is not None and len(plan.members) == 4 and watcher.rounds_done else None

                plan = await peers.wait_until(four, STEP_S, what="a plan of four and a step of it")
                coordinator = watcher.election.coordinator
                reporter.append(next(m for m in plan.members if m not in (coordinator, watcher.me)))
                await peers.wait_until(lambda: REPORTED or None, STEP_S, what="the reporter's report as its summary opens")
                honest = [r for r in runs if r.me != reporter[0]]
                version = max(r.book.chain.version for r in honest)

                def a_checkpoint_without_the_reporter():
                    books = [r.book for r in honest]
                    if any(b is None for b in books):
                        return None
                    for v in range(version, min(b.chain.version for b in books)):
                        records = [b.chain.records[v].record for b in books]
                        assert all(r == records[0] for r in records), records  # the same record everywhere
                        if reporter[0] not in records[0].members:
                            return records[0]
                    return None

                record = await peers.wait_until(a_checkpoint_without_the_reporter, STEP_S,
                                                what="a checkpoint of a span without the reporter, after its reports")
                refused = [r.rejected.get("failure_report", 0) for r in honest]
        nursery.cancel_scope.cancel()
    print("reports:", REPORTED, "refused:", refused, "blamed:", [(m[-6:], c[-6:]) for m, c in BLAMED],
          "reporter:", reporter[0][-6:], "record members:", [m[-6:] for m in record.members])
    # Each report was refuted where the step completed (counted), or the step was left naming the
    # reporter; either way it is left out of the plans, and a span without it checkpointed.
    assert sum(refused) >= 1 or any(c == reporter[0] for _, c in BLAMED), (refused, BLAMED)
    assert reporter[0] not in record.members, record
