"""A member that starts with the task's chain on its home resumes the run from its last record.

After a stop of this member or of the whole run (a power cut, every machine stopped for the night),
``chain.jsonl`` (run/_chain_file.py) holds the records this member confirmed. It resumes from
the last one: that checkpoint's model and optimizer state by CID (from its own store, or from the
peers that hold them), verified as a resync loads them (:meth:`Resync.load_chain`), and the error
feedback it kept there. Its election starts after that record's term, with that record's members
as the roster, so the members that come back elect a coordinator although nobody is left to publish
plans or heads; the first plan starts at the record's step and its rounds are numbered after it.

Before it says it holds the run's state (and so may lead, and be planned), it hears the others:
it asks for the task's head, and every member that holds the chain and is not in a run under way
answers with its own (services/_head_answers.py). Heads are heard here only from the members of our
last record (the rule comes from our own chain, not from the head's sender). The longest chain they
name that extends ours is loaded as a resync loads one (fetched by CID, re-verified, its records
signed by their terms' coordinators where known; a fork is refused and counted), so members whose
chains differ in length settle on the longest that verifies before one of them leads. It stops
listening once every other member of that record answered, once the run's coordinator is known (the
run went on without this member: the resync loop takes it from there), or after RESUME_WAIT_S.

A member that resumed still answers the others' head requests until its election accepts a
coordinator (:meth:`Resume.answers_heads`; services/_tasks.py asks it): a member that resumes later
asks for heads only once it has loaded its own checkpoint, and one that had already heard everyone
and said it held the run's state answered nothing once its run was under way. Where the two could
not elect a coordinator without the others (fewer than a quorum of the record's members), the late
one waited the whole RESUME_WAIT_S for a member that had resumed seconds before it.

The resync loop starts only after this (run/_task_run.py): a plan that lists this member meanwhile
waits in its catch-up queue, so one load at a time changes the member's state, and the record the
member says it resumed from (``resumed_from``) is the one it loaded here, never a record the run
confirmed later. Any message of the task wakes the wait (:meth:`Resume.nudge`), so a coordinator
heard ends it at once and the plan's members do not wait for this member's channels.
"""

from __future__ import annotations

import logging

import trio

from p2ptrain.base import short_id
from p2ptrain.run._resync import Resync
from p2ptrain.run._run_state import Nudge, RunState
from p2ptrain.control import Phase
from p2ptrain.protocol import Chain
from p2ptrain.wire import HeadRequest, TASKS_TOPIC, TaskHead

logger = logging.getLogger(__name__)

# How long a resuming member waits for the other members of its last record to answer: they restart
# on their own machines, each importing torch and libp2p (seconds, tens of seconds on a loaded box).
# A member that does not come back costs the others this much before the first plan.
RESUME_WAIT_S = 20.0
# Meanwhile it asks this often (a request published before our pubsub mesh formed is lost, and a
# member that started later only hears the requests after its own start); each node answers a task
# at most once per second (services/_head_answers.py).
ASK_EVERY_S = 1.0


class Resume:
    """Resuming from the chain on this member's home: its own checkpoint, then the others' heads."""

    def __init__(self, run: RunState, resync: Resync) -> None:
        self.run = run
        self.resync = resync
        self.hearing = False  # between load_own and the end of hear_others: heads come here
        self.resumed = False  # hear_others is over: this member said it holds the run's state
        self.heads: dict[str, TaskHead] = {}  # member of our last record -> the latest head it answered
        self._news = Nudge()

    async def load_own(self, chain: Chain) -> None:
        """Load the last checkpoint of ``chain`` (the run's chain file, verified) as this member's
        state, before the run's loops start; it is not yet said to be the run's (:meth:`hear_others`)."""
        run = self.run
        run.phase = Phase.RESUMING
        last = chain.records[-1].record
        logger.info("%s: resuming from this home's chain: model v%d at step %d", run.log_prefix, last.version, last.step)
        await self.resync.load_chain(chain, sync=False)
        run.election.resume_after(last.term)
        run.resumed_from = {"version": last.version, "step": last.step}
        self.hearing = True

    def answers_heads(self) -> bool:
        """Whether this member resumed and its election has accepted no coordinator since: it
        answers head requests as a member still resuming does (the module docstring says why).
        The run's coordinators publish its heads from the first one accepted on."""
        return self.resumed and not self.resync.coordinators and self.run.election.coordinator is None

    def nudge(self) -> None:
        """A message of the task arrived: while hearing, check again whether to stop (the run's
        coordinator may be known now)."""
        if self.hearing:
            self._news.set()

    def on_head(self, sender: str, head: TaskHead) -> bool:
        """While hearing the others: keep the head a member of our last record answered (anyone
        else's is counted and dropped) and say True; False once hearing is over (the resync path's)."""
        if not self.hearing:
            return False
        run = self.run
        _, book = run.require()
        if sender not in book.chain.records[-1].record.members:
            run.refuse("head_untrusted", f"ignored a head (model v{head.version}) while resuming: "
                       "its sender is no member of this member's last confirmed record")
            return True
        held = self.heads.get(sender)
        if held is None or (head.version, head.step) >= (held.version, held.step):
            self.heads[sender] = head
        self._news.set()
        return True

    async def hear_others(self) -> None:
        """Ask for the others' heads until every other member of our last record answered, the
        run's coordinator is known, or RESUME_WAIT_S passed; load the longest chain named that
        extends ours (the next when one cannot be loaded); then hold the run's state."""
        if not self.hearing:
            return
        run = self.run
        _, book = run.require()
        others = set(book.chain.records[-1].record.members) - {run.me}
        deadline = trio.current_time() + RESUME_WAIT_S
        asked = -ASK_EVERY_S
        while not others <= set(self.heads) and run.election.coordinator is None:
            now = trio.current_time()
            if now >= deadline:
                missing = ", ".join(short_id(p) for p in sorted(others - set(self.heads)))
                logger.warning("%s: member(s) %s of model v%d did not answer in %.0f s; going on without them",
                               run.log_prefix, missing, book.chain.version, RESUME_WAIT_S)
                break
            if now - asked >= ASK_EVERY_S:
                await run.node.publish(TASKS_TOPIC, HeadRequest(task_cid=run.task_cid))
                asked = now
            await self._news.wait(min(asked + ASK_EVERY_S, deadline) - now)
        failed = False  # the last load tried failed
        own = book.chain.version
        resumed = {"version": own, "step": book.head_step}
        for head in sorted(self.heads.values(), key=lambda h: (h.version, h.step), reverse=True):
            if head.version <= own:
                break
            logger.info("%s: a member holds model v%d, past this home's: loading it", run.log_prefix, head.version)
            failed = await self.resync.try_load_head(head) is not None
            if not failed:
                resumed = {"version": head.version, "step": head.step}
                break
        if failed:  # a load that failed may have failed half-way: our own checkpoint again
            await self.resync.try_load_last_checkpoint()
        self.hearing = False  # only now: heads go to the resync loop, which starts after this
        self.resumed = True
        _, book = run.require()
        run.election.resume_after(book.chain.records[-1].record.term)  # the first term's clock starts now
        run.resumed_from = resumed
        logger.info("%s: resumed at model v%d, step %d (%d other member(s) answered)", run.log_prefix,
                    resumed["version"], resumed["step"], len(self.heads))
        if not run.synced:
            run.set_synced()
            run.end_if_over()
