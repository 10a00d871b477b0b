"""Chaos bench: faults and a hostile peer against real `p2ptrain node start` processes.

    PYTHONPATH=$PWD .venv/bin/python bench/chaos.py [--quick] [--json] [--only NAME ...]

Three clusters of real node processes on loopback train scikit-learn's digits (an MLP, top-k sparse
all-reduce, a checkpoint every few dozen rounds) on a task long enough never to finish while the
bench runs:

- the *fault* cluster (4 peers) takes crashes, freezes and a full disk, one scenario after another;
- the *hostile* cluster (3 honest peers with --accept-tasks) is attacked by a hostile libp2p peer
  (bench/hostile.py) doing each attack of issue 13, one scenario after another;
- the *members* cluster (3 honest peers, a task with ``compression.robust = "clip"``) takes a
  hostile *member* (bench/hostile_member.py: a real p2ptrain peer in the bench's process that
  joins the run, trains, votes and lies; one per scenario, gone after it).

All run at once (``--serial``: one after the other). Before each scenario the cluster is made whole
again, outside the scenario's timing: a node that died is restarted on its home (with --join), and
the bench waits (bounded) until every node is in the plan and training moves; ``detail.settle_s``
and ``detail.whole_at_start`` say how that went, so one scenario's damage is not charged to the next.

For every scenario it reports:

- ``survived``: no honest node exited (nodes the scenario kills on purpose do not count);
- ``recover_s``: seconds from the fault (for an attack: from the moment the attacker left) until
  training has made progress again: the highest step any surviving member reports in
  ``task status`` is ``PROGRESS_STEPS`` past its value at that moment (so the round in flight at the
  fault does not count). ``null`` when progress did not resume within the scenario's bound;
- ``lost_models``: confirmed models (version, CID) seen on any node before the fault that no node
  holds after it, plus versions at which two nodes' confirmed chains disagree (forks); must be 0;
- ``corrupted_blocks``: blocks under the honest nodes' homes that do not hash to their CID, by
  ``p2ptrain repo verify``;
- for a hostile member, ``detail.attack.poisoned_confirmed`` (must be 0; the bench exits 1 otherwise):
  confirmed records of the hostile coordinator or of its model, or of a span the hostile owner
  took part in whose accuracy fell below half the run's before it joined.

Scenarios (``--only`` takes these names; a prefix selects a group, e.g. ``--only hostile``):

  kill_member                SIGKILL a member that is not the coordinator mid-round, repeatedly (restarted between)
  restart_same_home          the killed members restarted on their homes: seconds until back in a round's plan
  stop_member                SIGSTOP a member past the hop deadline, then SIGCONT
  kill_provider_mid_fetch    SIGKILL one of two providers while a third node fetches a blob
  kill_coordinator           SIGKILL the elected coordinator
  full_disk                  a member's home on a small tmpfs filled up across checkpoints, then freed (root only)
  kill_all                   SIGKILL every member at once, then restart all on their homes (with --join): steps
                             trained again (<= the checkpoint interval), records lost (0), seconds from the
                             restart to the first round
  hostile_flood              1,000 signed messages/s on the mesh topic; `node status` latency measured
  hostile_collective_hello   80 collective HELLO channels per node from a non-member (issue 13, #4)
  hostile_bitswap_pinning    200 Bitswap streams each holding most of a 4 MiB message (#5)
  hostile_fresh_identities   heartbeats from up to 9,000 throwaway identities (#7)
  hostile_empty_dagpb_task   a task announcement naming the empty dag-pb block (#2)
  hostile_control_socket     a control-socket line of 100,000 '[' (a local attacker) (#6)
  hostile_ts_overflow        a signed envelope with ts=10**400 on the mesh topic, sent to one node (#1)
  hostile_dag_bomb_task      a task announcement naming a 3-level, 174-link DAG bomb (#3)
  hostile_model_bomb         tasks whose initial_model declares 2 GiB (one leaf repeated) or is 256 MiB of
                             distinct leaves under a root that declares 1,000 bytes (issue 27)
  hostile_head_flood         forged heads of the run (v999, 1,024 members, ~57 KB) at 131/s: steps/s against
                             the same run just before (issue 27)
  hostile_head_request_flood head requests for the run at 2,600/s: steps/s likewise (issue 27)
  hostile_heartbeat_sybils   5 identities whose heartbeats advertise the run (never vote, never train) for >= 30 s:
                             checkpoints confirmed meanwhile, Sybils planned, steps/s against just before (issue 27)
  hostile_forged_latest      heads at v999 (one naming the honest chain and model CIDs) while an outsider runs
                             `model fetch --latest` through a node: it gets an honest model (issue 27)
  hostile_targeted_owner     (members) a member that, as a chunk's owner, writes 1000.0 into every value of the
                             chunk it reduces: named by the verifiers (`named_by`), left out of plans,
                             `poisoned_confirmed` 0, accuracy against the same run's just before (issue 27)
  hostile_equivocation       (members) an owner that sends the first node other bytes for its chunk (signed anew)
                             than the rest: named, left out, the round retried, checkpoints confirmed (issue 27)
  hostile_coordinator        (members) a member whose key is ground to be the designated candidate of the next
                             terms; the honest coordinator stalls 12 s (SIGSTOP) and it is elected; its records
                             name only itself and a model nobody trained, attested by itself: no honest node
                             confirms it (`poisoned_confirmed` 0), they accuse it (`accused_by`) and elect
                             one of their own (issue 27)
  hostile_serve_bodies       `model serve` of the run's model on a node's home: 32 clients declaring 8 MiB
                             and trickling, 4 posting 2.3-6.7 MB bodies; honest requests' status and p50
                             against their baseline (issue 27)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import trio

import hostile
import hostile_bounds
import hostile_member
from p2ptrain.task import TASK_TEMPLATE
from p2ptrain.base import UserError
from p2ptrain.ipfs import BlockStore, DAG_PB, encode_file_leaf, make_cid
from p2ptrain.control import ControlClient, ops as control_ops
from p2ptrain.run import HOP_TIMEOUT_S
from p2ptrain.testing import NodeProcess, free_port

NODE_ARGS = ["--device", "cpu", "--threads", "1"]
# A task that outlives the bench: it must keep training through every scenario.
TOTAL_STEPS = 1_000_000
CHECKPOINT_INTERVAL = 50  # ~1.5 s of rounds on loopback: several checkpoints per scenario, a short chain
# Progress means this many rounds completed after the moment measured from (the round in flight at a
# fault may still complete; two more cannot without the survivors re-planning around it).
PROGRESS_STEPS = 3
POLL_S = 0.2  # how often the bench reads `task status` while it waits for progress
STATUS_TIMEOUT_S = 5.0  # one control call; a node that does not answer in this long is "not answering"
READY_TIMEOUT_S = 180.0  # a node process imports libp2p and torch: slow on a loaded 2-core box
TRAINING_TIMEOUT_S = 120.0  # from publishing the task to the first completed rounds
STOP_TIMEOUT_S = 20.0  # SIGTERM, then SIGKILL
VERIFY_TIMEOUT_S = 60.0  # one `repo verify` run
TMPFS_BYTES = 64 << 20  # the full-disk member's home: room for its dataset shards, checkpoints and logs
# SIGSTOP this long: past the hop deadline with room for the survivors to re-plan without the frozen member.
FREEZE_S = HOP_TIMEOUT_S + 5.0
# Before a fault scenario, the cluster gets this long to be whole again (restarted nodes back in the plan).
SETTLE_TIMEOUT_S = 45.0
# After an attack, wait this long before judging: a node dying of an uncaught error logs, stops its
# services and exits over a second or two (more on a loaded machine: 3 s once missed one).
EXIT_GRACE_S = 5.0


@dataclass(frozen=True)
class Sizes:
    """How hard each scenario pushes and how long it may wait: --quick is lean, the default is fuller."""

    kill_repeats: int
    recover_timeout_s: float
    rejoin_timeout_s: float
    blob_bytes: int
    full_disk_hold_s: float
    attack_hold_s: float
    flood_s: float
    identities: int
    model_chunks: int  # distinct 256 KiB leaves of hostile_model_bomb's second model
    budget_s: float


QUICK = Sizes(kill_repeats=2, recover_timeout_s=30, rejoin_timeout_s=60, blob_bytes=32 << 20, full_disk_hold_s=5,
              attack_hold_s=5, flood_s=5, identities=hostile.FRESH_IDENTITIES, model_chunks=256, budget_s=240)
FULL = Sizes(kill_repeats=5, recover_timeout_s=90, rejoin_timeout_s=120, blob_bytes=64 << 20, full_disk_hold_s=15,
             attack_hold_s=20, flood_s=20, identities=hostile.FRESH_IDENTITIES,
             model_chunks=hostile_bounds.MODEL_FLOOD_CHUNKS, budget_s=1800)


@dataclass
class Result:
    name: str
    survived: bool | None = None
    recover_s: float | None = None
    lost_models: int | None = None
    corrupted_blocks: int | None = None
    exited: dict[str, int] = field(default_factory=dict)  # honest node -> exit code
    seconds: float = 0.0  # the scenario's own wall time
    skipped: str | None = None
    error: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def say(*parts: Any) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


# ---- blocks: `p2ptrain repo verify` ----------------------------------------------------------------


def _cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "p2ptrain.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def repo_verify(home: Path) -> int:
    """Blocks of ``home`` that `p2ptrain repo verify` finds not hashing to their CID (exit 0: none)."""
    done = _cli("repo", "verify", "--home", str(home), "--json", timeout=VERIFY_TIMEOUT_S)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"repo verify {home} exited {done.returncode}: {done.stderr.strip()[-300:]}")
    return len(json.loads(done.stdout)["bad"])


def corrupted_blocks(homes: list[Path]) -> int:
    """Bad blocks summed over ``homes``."""
    return sum(repo_verify(h) for h in homes)


# ---- node processes --------------------------------------------------------------------------------


class Cluster:
    """N node processes on loopback, each bootstrapping from all others; stopped (SIGCONT, SIGTERM,
    SIGKILL after ``STOP_TIMEOUT_S``) and any tmpfs unmounted on exit, whatever happened."""

    def __init__(self, base: Path, n: int, extra_args: list[str], tmpfs_node: int | None = None) -> None:
        self.base = base
        self.n = n
        self.extra_args = extra_args
        self.tmpfs_node = tmpfs_node
        self.mounted: list[Path] = []
        self.procs: list[NodeProcess] = []
        self.killed: set[str] = set()  # nodes killed on purpose by the running scenario
        self.frozen: set[str] = set()  # nodes SIGSTOPped right now: not asked anything (they cannot answer)
        self.task_cid = ""
        self.manifest = ""  # the run's data set (attacks name it in tasks of their own)

    def __enter__(self) -> Cluster:
        try:
            for i in range(self.n):
                home = self.base / f"node{i}"
                home.mkdir(parents=True, mode=0o700)
                if i == self.tmpfs_node:
                    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0700", "tmpfs", str(home)],
                                   check=True, capture_output=True, timeout=30)
                    self.mounted.append(home)
                self.procs.append(NodeProcess(home, free_port(), extra_args=self.extra_args))
            for p in self.procs:
                p.bootstrap = [q.addr for q in self.procs if q is not p]
                p.start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs:
            if p.proc is not None and p.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.proc.send_signal(signal.SIGCONT)  # a frozen node cannot act on SIGTERM
                    p.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S  # one deadline for all: a wedged node costs it once
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.terminate(max(0.1, deadline - time.monotonic()))
        for home in self.mounted:
            subprocess.run(["umount", "-l", str(home)], capture_output=True, timeout=30)

    def name(self, p: NodeProcess) -> str:
        return p.home.name

    def alive(self) -> list[NodeProcess]:
        return [p for p in self.procs if p.proc is not None and p.proc.poll() is None]

    def unexpected_exits(self) -> dict[str, int]:
        return {self.name(p): p.proc.returncode for p in self.procs
                if p.proc is not None and p.proc.poll() is not None and self.name(p) not in self.killed}

    def kill(self, p: NodeProcess) -> None:
        self.killed.add(self.name(p))
        p.kill()

    def kill_all(self) -> None:
        """SIGKILL every live node at once (a power cut), then reap them."""
        victims = self.alive()
        for p in victims:
            self.killed.add(self.name(p))
            p.proc.kill()
        for p in victims:
            p.kill()

    async def wait_ready(self, procs: list[NodeProcess]) -> None:
        async with trio.open_nursery() as nursery:
            for p in procs:
                nursery.start_soon(trio.to_thread.run_sync, p.wait_ready, READY_TIMEOUT_S)

    async def restart(self, p: NodeProcess, wait: bool = True) -> None:
        """Start ``p`` again on its home (its task named with --join, as an operator would)."""
        with contextlib.suppress(Exception):
            p.log.close()
        if self.task_cid and "--join" not in p.extra_args:
            p.extra_args = [*p.extra_args, "--join", self.task_cid]
        p.start()
        self.killed.discard(self.name(p))
        if wait:
            await self.wait_ready([p])


async def call(p: NodeProcess, op: str, params: dict[str, Any] | None = None,
               timeout: float = STATUS_TIMEOUT_S) -> dict[str, Any] | None:
    """One control call, off the event loop; None if the node does not answer."""
    def _call() -> dict[str, Any] | None:
        try:
            return ControlClient(p.home, timeout=timeout).call(op, **(params or {}))
        except (UserError, OSError, ValueError):
            return None
    return await trio.to_thread.run_sync(_call)


async def statuses(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """`task status` of every answering node, read in parallel."""
    out: dict[str, dict[str, Any]] = {}

    async def one(p: NodeProcess) -> None:
        s = await call(p, control_ops.TASK_STATUS, {"task_cid": cluster.task_cid})
        if s is not None and s.get("member"):
            out[cluster.name(p)] = s

    async with trio.open_nursery() as nursery:
        for p in cluster.alive():
            if cluster.name(p) not in cluster.frozen:
                nursery.start_soon(one, p)
    return out


def top_step(snap: dict[str, dict[str, Any]]) -> int:
    return max((s.get("step") or 0 for s in snap.values()), default=0)


async def wait_progress(cluster: Cluster, since_step: int, started: float, timeout: float) -> float | None:
    """Seconds from ``started`` (trio clock) until some member reports ``since_step + PROGRESS_STEPS``."""
    deadline = started + timeout
    while trio.current_time() < deadline:
        if top_step(await statuses(cluster)) >= since_step + PROGRESS_STEPS:
            return round(trio.current_time() - started, 2)
        await trio.sleep(POLL_S)
    return None


def models_of(snap: dict[str, dict[str, Any]], cluster: Cluster) -> dict[str, dict[int, str]]:
    """Each node's confirmed chain, version -> model CID: from `task status`, or from the chain file
    of a node that does not answer (a dead node's confirmed models are on its disk)."""
    out = {name: {c["version"]: c["model_cid"] for c in s.get("chain") or []} for name, s in snap.items()}
    for p in cluster.procs:
        name = cluster.name(p)
        if name in out:
            continue
        path = p.home / "tasks" / cluster.task_cid / "chain.jsonl"
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            records = [json.loads(line)["record"] for line in path.read_text().splitlines() if line.strip()]
            out[name] = {r["version"]: r["model_cid"] for r in records}
    return out


def lost_models(before: dict[str, dict[int, str]], after: dict[str, dict[int, str]]) -> tuple[int, dict[str, Any]]:
    """Models confirmed before that no node holds after, plus versions at which nodes disagree."""
    held_after = {(v, c) for chain in after.values() for v, c in chain.items()}
    lost = {(v, c) for chain in before.values() for v, c in chain.items()} - held_after
    by_version: dict[int, set[str]] = {}
    for chain in after.values():
        for v, c in chain.items():
            by_version.setdefault(v, set()).add(c)
    forks = sorted(v for v, cids in by_version.items() if len(cids) > 1)
    return len(lost) + len(forks), {"lost": sorted(v for v, _ in lost)[:10], "forked_versions": forks[:10],
                                    "top_version": max(by_version, default=0)}


async def start_training(cluster: Cluster, join_others: bool, robust: str | None = None,
                         checkpoint: int = CHECKPOINT_INTERVAL) -> None:
    """Add digits on the first node, publish the long task there (with ``compression.robust``, if
    given), have the others join, and wait for the first completed rounds."""
    from p2ptrain.data import build_dataset, load_source
    from p2ptrain.ipfs import EmbeddedStore

    first = cluster.procs[0]
    name, features, labels = load_source("sklearn:digits")
    manifest, _ = await trio.to_thread.run_sync(
        lambda: build_dataset(EmbeddedStore(first.home), name, features, labels, num_shards=8))
    cluster.manifest = manifest
    text = TASK_TEMPLATE.format(manifest=manifest, steps=TOTAL_STEPS, checkpoint=checkpoint,
                                density=0.01, peers=8).replace("demo-digits-mlp", "chaos-digits-mlp")
    if robust is not None:
        text = text.replace("error_feedback = true\n", f'error_feedback = true\nrobust = "{robust}"\n')
    published = await call(first, control_ops.TASK_PUBLISH, {"text": text, "join": True}, timeout=120)
    if published is None:
        raise RuntimeError(f"{control_ops.TASK_PUBLISH} failed on {first.home}:\n{first.read_log()}")
    cluster.task_cid = published["task_cid"]
    if join_others:
        for p in cluster.procs[1:]:
            await call(p, control_ops.TASK_JOIN, {"task_cid": cluster.task_cid}, timeout=120)
    started = trio.current_time()
    with trio.fail_after(TRAINING_TIMEOUT_S):
        while True:
            snap = await statuses(cluster)
            if len(snap) == cluster.n and top_step(snap) >= PROGRESS_STEPS and \
                    all(len(s.get("members") or []) == cluster.n for s in snap.values()):
                break
            await trio.sleep(POLL_S)
    say(f"{cluster.base.name}: training on {cluster.n} nodes after {trio.current_time() - started:.1f} s "
        f"(task {cluster.task_cid})")


def member_procs(cluster: Cluster, snap: dict[str, dict[str, Any]]) -> tuple[str | None, list[NodeProcess]]:
    """The coordinator's peer ID and the live nodes that are not it."""
    coordinator = next((s.get("coordinator") for s in snap.values() if s.get("coordinator")), None)
    return coordinator, [p for p in cluster.alive() if p.peer_id != coordinator]


def rss_mb(p: NodeProcess) -> float | None:
    """The node's resident memory now, from /proc (None once it has exited)."""
    with contextlib.suppress(OSError, AttributeError, ValueError):
        for line in Path(f"/proc/{p.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return None


def cpu_s(p: NodeProcess) -> float | None:
    """CPU seconds the node has used (user + system), from /proc."""
    with contextlib.suppress(OSError, AttributeError, ValueError, IndexError):
        fields = Path(f"/proc/{p.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return None


async def finish(cluster: Cluster, result: Result, before: dict[str, dict[int, str]]) -> None:
    """Fill in survived, lost_models and corrupted_blocks for a scenario that has run."""
    result.exited = cluster.unexpected_exits()
    result.survived = not result.exited
    after = models_of(await statuses(cluster), cluster)
    result.lost_models, result.detail["models"] = lost_models(before, after)
    homes = [p.home for p in cluster.procs]
    result.corrupted_blocks = await trio.to_thread.run_sync(corrupted_blocks, homes)


# ---- fault scenarios (the 4-node cluster) ---------------------------------------------------------


async def kill_member(cluster: Cluster, sizes: Sizes, result: Result) -> None:
    before = models_of(await statuses(cluster), cluster)
    times, victims = [], []
    for _ in range(sizes.kill_repeats):
        snap = await statuses(cluster)
        _, others = member_procs(cluster, snap)
        candidates = [p for p in others if cluster.name(p) not in victims and cluster.name(p) in snap] or others
        victim = candidates[0]
        killed_at = trio.current_time()
        cluster.kill(victim)
        victims.append(cluster.name(victim))
        step = top_step(await statuses(cluster))  # read after the kill: rounds done before it do not count
        t = await wait_progress(cluster, step, killed_at, sizes.recover_timeout_s)
        times.append(t)
        await cluster.restart(victim, wait=False)  # back for the next kill; restart_same_home waits for it
    result.recover_s = None if None in times else max(times)
    result.detail.update(victims=victims, recover_each_s=times)
    await finish(cluster, result, before)


async def restart_same_home(cluster: Cluster, sizes: Sizes, result: Result) -> None:
    """The nodes restarted by kill_member (or all, if run alone: kill one and restart it here)."""
    before = models_of(await statuses(cluster), cluster)
    started = trio.current_time()
    restarted = [p for p in cluster.procs if "--join" in p.extra_args]
    if not restarted:
        _, others = member_procs(cluster, await statuses(cluster))
        cluster.kill(others[0])
        await cluster.restart(others[0], wait=False)
        restarted = [others[0]]
    await cluster.wait_ready(restarted)
    ready_s = round(trio.current_time() - started, 2)
    want = {p.peer_id for p in restarted}
    back = None
    while trio.current_time() < started + sizes.rejoin_timeout_s:
        snap = await statuses(cluster)
        members = {m for s in snap.values() for m in s.get("members") or []}
        if want <= members and all(cluster.name(p) in snap for p in restarted):
            back = round(trio.current_time() - started, 2)
            break
        await trio.sleep(POLL_S)
    result.recover_s = back
    result.detail.update(restarted=[cluster.name(p) for p in restarted], ready_s=ready_s,
                         note="recover_s: from the restart until the node is in a round's plan again")
    await finish(cluster, result, before)


async def stop_member(cluster: Cluster, sizes: Sizes, result: Result) -> None:
    snap = await statuses(cluster)
    before = models_of(snap, cluster)
    _, others = member_procs(cluster, snap)
    victim = others[-1]
    started = trio.current_time()
    victim.proc.send_signal(signal.SIGSTOP)
    cluster.frozen.add(cluster.name(victim))
    try:
        step = top_step(await statuses(cluster))
        # Progress while it is frozen counts: the others must not wait for it past the hop deadline.
        recovered = await wait_progress(cluster, step, started, FREEZE_S)
        await trio.sleep_until(started + FREEZE_S)
        frozen_step = top_step(await statuses(cluster))
    finally:
        victim.proc.send_signal(signal.SIGCONT)
        cluster.frozen.discard(cluster.name(victim))
    resumed_at = trio.current_time()
    result.recover_s = recovered or await wait_progress(cluster, step, started, FREEZE_S + sizes.recover_timeout_s)
    back = None
    while trio.current_time() < resumed_at + sizes.rejoin_timeout_s:
        snap = await statuses(cluster)
        if cluster.name(victim) in snap and any(victim.peer_id in (s.get("members") or []) for s in snap.values()) \
                and snap[cluster.name(victim)]["step"] >= top_step(snap) - CHECKPOINT_INTERVAL:
            back = round(trio.current_time() - resumed_at, 2)
            break
        await trio.sleep(POLL_S)
    result.detail.update(victim=cluster.name(victim), frozen_s=FREEZE_S, steps_while_frozen=frozen_step - step,
                         rejoined_after_sigcont_s=back)
    await finish(cluster, result, before)


def _fill(path: Path) -> int:
    """Write zeros to ``path`` until the filesystem is full; bytes written."""
    written = 0
    chunk = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        while written < 1 << 34:
            try:
                written += f.write(chunk)
            except OSError:
                with contextlib.suppress(OSError):
                    while True:
                        written += f.write(b"\0" * 4096)
                break
    return written


async def full_disk(cluster: Cluster, sizes: Sizes, result: Result) -> None:
    if cluster.tmpfs_node is None:
        result.skipped = "needs root to mount a tmpfs home (run as root)"
        return
    victim = cluster.procs[cluster.tmpfs_node]
    snap = await statuses(cluster)
    before = models_of(snap, cluster)
    version = max((s.get("version") or 0 for s in snap.values()), default=0)
    coordinator, _ = member_procs(cluster, snap)
    filler = victim.home / "filler"
    started = trio.current_time()
    filled = await trio.to_thread.run_sync(_fill, filler)
    try:
        step = top_step(await statuses(cluster))
        result.recover_s = await wait_progress(cluster, step, started, sizes.recover_timeout_s)
        await trio.sleep(max(0.0, sizes.full_disk_hold_s - (trio.current_time() - started)))
        snap = await statuses(cluster)
        checkpoints = max((s.get("version") or 0 for s in snap.values()), default=0) - version
    finally:
        filler.unlink(missing_ok=True)
    freed_at = trio.current_time()
    caught_up = None
    while victim.proc.poll() is None and trio.current_time() < freed_at + sizes.rejoin_timeout_s:
        snap = await statuses(cluster)
        mine = snap.get(cluster.name(victim))
        top_version = max((s.get("version") or 0 for s in snap.values()), default=0)
        if mine is not None and mine.get("version") == top_version and victim.peer_id in (mine.get("members") or []):
            caught_up = round(trio.current_time() - freed_at, 2)
            break
        await trio.sleep(POLL_S)
    result.detail.update(victim=cluster.name(victim), victim_was_coordinator=victim.peer_id == coordinator,
                         filled_mb=round(filled / 2**20, 1),
                         checkpoints_while_full=checkpoints, caught_up_after_free_s=caught_up)
    await finish(cluster, result, before)


async def kill_provider_mid_fetch(cluster: Cluster, sizes: Sizes, result: Result) -> None:
    from p2ptrain.ipfs import EmbeddedStore

    snap = await statuses(cluster)
    before = models_of(snap, cluster)
    alive = cluster.alive()
    if len(alive) < 3:
        result.skipped = "needs 3 live nodes (a fetcher and two providers)"
        return
    fetcher, providers = alive[0], alive[1:3]
    blob = os.urandom(sizes.blob_bytes)
    for p in providers:
        cid = await trio.to_thread.run_sync(EmbeddedStore(p.home).add_bytes, blob)
    leaves = [make_cid(encode_file_leaf(blob[i: i + (256 << 10)]), DAG_PB, 0) for i in range(0, 8 * (256 << 10), 256 << 10)]
    fetched = BlockStore(fetcher.home / "blocks")
    outcome: dict[str, Any] = {}

    async def fetch() -> None:
        t = trio.current_time()
        outcome["answer"] = await call(fetcher, control_ops.IPFS_FETCH, {"cid": cid, "timeout": sizes.recover_timeout_s},
                                       timeout=sizes.recover_timeout_s + 30)
        outcome["done_at"] = trio.current_time()
        outcome["fetch_s"] = round(outcome["done_at"] - t, 2)

    victim = providers[0]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fetch)
        with trio.move_on_after(hostile.IO_TIMEOUT_S):
            while "done_at" not in outcome and not any(fetched.has(c) for c in leaves):
                await trio.sleep(0.01)
        mid = "done_at" not in outcome
        killed_at = trio.current_time()
        cluster.kill(victim)
        step = top_step(await statuses(cluster))
    fetch_recover = round(outcome["done_at"] - killed_at, 2) if outcome.get("answer") is not None else None
    train_recover = await wait_progress(cluster, step, killed_at, sizes.recover_timeout_s)
    result.recover_s = None if fetch_recover is None or train_recover is None else max(fetch_recover, train_recover)
    result.detail.update(victim=cluster.name(victim), blob_mb=sizes.blob_bytes >> 20, killed_mid_fetch=mid,
                         fetch_ok=outcome.get("answer") is not None, fetch_s=outcome.get("fetch_s"),
                         fetch_done_after_kill_s=fetch_recover, training_recover_s=train_recover,
                         fetched_intact=outcome.get("answer") is not None and
                         await trio.to_thread.run_sync(lambda: EmbeddedStore(fetcher.home).cat(cid) == blob))
    await finish(cluster, result, before)
    await cluster.restart(victim, wait=False)


async def kill_coordinator(cluster: Cluster, sizes: Sizes, result: Result) -> None:
    snap = await statuses(cluster)
    before = models_of(snap, cluster)
    coordinator, _ = member_procs(cluster, snap)
    boss = next((p for p in cluster.alive() if p.peer_id == coordinator), None)
    if boss is None:
        result.skipped = "no coordinator elected among the live nodes"
        return
    term = max((s.get("term") or 0 for s in snap.values()), default=0)
    started = trio.current_time()
    cluster.kill(boss)
    step = top_step(await statuses(cluster))
    result.recover_s = await wait_progress(cluster, step, started, sizes.recover_timeout_s)
    snap = await statuses(cluster)
    result.detail.update(victim=cluster.name(boss), old_term=term,
                         new_term=max((s.get("term") or 0 for s in snap.values()), default=0),
                         new_coordinator_is_other=all(s.get("coordinator") != coordinator for s in snap.values()))
    await finish(cluster, result, before)


def chain_steps(cluster: Cluster) -> dict[str, int]:
    """Each node's last confirmed step, from the chain file on its disk (0 for none)."""
    out = {}
    for p in cluster.procs:
        path = p.home / "tasks" / cluster.task_cid / "chain.jsonl"
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, IndexError):
            out[cluster.name(p)] = json.loads(path.read_text().splitlines()[-1])["record"]["step"]
    return out


async def kill_all(cluster: Cluster, sizes: Sizes, result: Result) -> None:
    """Every member killed at once, then all restarted on their homes: they resume from the last
    confirmed record. ``steps_lost``: rounds done before the kill past that record (trained again);
    ``recover_s``: from the restart until the first round completes; ``ready_s``: until every node
    answers again."""
    # A run with confirmed models on every node (the chain to resume from), killed inside a span.
    with trio.move_on_after(sizes.recover_timeout_s):
        while min((s.get("version") or 0 for s in (await statuses(cluster)).values()), default=0) < 2:
            await trio.sleep(POLL_S)
    await trio.sleep(CHECKPOINT_INTERVAL * 0.02)  # land anywhere in a span, not just after a checkpoint
    snap = await statuses(cluster)
    before = models_of(snap, cluster)
    reached = top_step(snap)
    cluster.kill_all()
    confirmed = max(chain_steps(cluster).values(), default=0)
    started = trio.current_time()
    for p in cluster.procs:
        await cluster.restart(p, wait=False)
    await cluster.wait_ready(cluster.procs)
    ready = trio.current_time()
    first_round, resumed = None, {}
    while trio.current_time() < ready + sizes.rejoin_timeout_s:
        snap = await statuses(cluster)
        resumed = {name: s.get("resumed_from") for name, s in sorted(snap.items())}
        if top_step(snap) > confirmed:
            first_round = trio.current_time()
            break
        await trio.sleep(POLL_S)
    result.recover_s = None if first_round is None else round(first_round - started, 2)
    result.detail.update(step_at_kill=reached, resumed_at_step=confirmed, steps_lost=max(0, reached - confirmed),
                         checkpoint_interval=CHECKPOINT_INTERVAL, ready_s=round(ready - started, 2),
                         first_round_after_ready_s=None if first_round is None else round(first_round - ready, 2),
                         resumed_from=resumed,
                         note="recover_s: from the restart until the first round after it completes; ready_s: "
                              "until every node process answers")
    await finish(cluster, result, before)


FAULTS: dict[str, Callable[[Cluster, Sizes, Result], Awaitable[None]]] = {
    "kill_member": kill_member,
    "restart_same_home": restart_same_home,
    "stop_member": stop_member,
    "kill_provider_mid_fetch": kill_provider_mid_fetch,
    "kill_coordinator": kill_coordinator,
    "full_disk": full_disk,  # late: a full disk on the coordinator can stall the run for a while
    "kill_all": kill_all,  # last: every node restarts (and it does not displace the others from --quick's budget)
}


# ---- hostile scenarios (3 honest nodes and the hostile peer) --------------------------------------

Attack = Callable[[hostile.HostilePeer, Cluster, Sizes], Awaitable[dict[str, Any]]]


async def _flood(peer: hostile.HostilePeer, cluster: Cluster, sizes: Sizes) -> dict[str, Any]:
    return await hostile.flood(peer, sizes.flood_s)


async def _fresh(peer: hostile.HostilePeer, cluster: Cluster, sizes: Sizes) -> dict[str, Any]:
    return await hostile.fresh_identities(peer, sizes.attack_hold_s * 2, sizes.identities)


async def _hello(peer: hostile.HostilePeer, cluster: Cluster, sizes: Sizes) -> dict[str, Any]:
    ids = [hostile.ID.from_base58(p.peer_id) for p in cluster.alive()]
    return await hostile.collective_hellos(peer, ids, sizes.attack_hold_s)


async def _bitswap(peer: hostile.HostilePeer, cluster: Cluster, sizes: Sizes) -> dict[str, Any]:
    return await hostile.bitswap_pinning(peer, hostile.ID.from_base58(cluster.procs[0].peer_id), sizes.attack_hold_s)


async def _bomb(peer: hostile.HostilePeer, cluster: Cluster, sizes: Sizes) -> dict[str, Any]:
    info = await hostile.dag_bomb_task(peer)
    await trio.sleep(sizes.attack_hold_s)  # the nodes fetch the blocks from us while we stay
    return info


async def _empty(peer: hostile.HostilePeer, cluster: Cluster, sizes: Sizes) -> dict[str, Any]:
    info = await hostile.empty_dagpb_task(peer)
    await trio.sleep(sizes.attack_hold_s)
    return info


async def _control(peer: hostile.HostilePeer, cluster: Cluster, sizes: Sizes) -> dict[str, Any]:
    return await trio.to_thread.run_sync(hostile.control_bomb, cluster.procs[0].home)


async def _ts(peer: hostile.HostilePeer, cluster: Cluster, sizes: Sizes) -> dict[str, Any]:
    info = await hostile.ts_overflow(peer)
    await trio.sleep(sizes.attack_hold_s)
    return info


async def _model_bomb(peer: hostile.HostilePeer, cluster: Cluster, sizes: Sizes) -> dict[str, Any]:
    """Both bomb tasks announced (again each second) until every node's runs of them have failed,
    at most attack_hold_s * 3; what each node said, and the bombs' blocks it kept."""
    sent = await hostile_bounds.model_bomb_tasks(peer, cluster.manifest, chunks=sizes.model_chunks)
    cids = sent.pop("cids")
    tasks = {sent[name]["task_cid"]: name for name in ("model-bomb", "model-flood")}
    refused: dict[str, dict[str, str]] = {}
    with trio.move_on_after(sizes.attack_hold_s * 3):
        while len(refused) < len(cluster.alive()) or any(len(r) < len(tasks) for r in refused.values()):
            for p in cluster.alive():
                listing = await call(p, control_ops.TASK_LIST) or {}
                for t in listing.get("tasks", []):
                    if t.get("task_cid") in tasks and (t.get("state") == "failed" or t.get("refused")):
                        why = t.get("error") or t.get("refused") or ""
                        refused.setdefault(cluster.name(p), {})[tasks[t["task_cid"]]] = why[-160:]
            await hostile_bounds.announce(peer, tasks)
            await trio.sleep(1.0)

    def kept(home: Path) -> int:
        blocks = BlockStore(home / "blocks")
        return sum(1 for cid in cids if blocks.has(cid))

    sent["refused"] = refused
    sent["blocks_kept"] = {cluster.name(p): await trio.to_thread.run_sync(kept, p.home) for p in cluster.procs}
    return sent


async def steps_per_s(cluster: Cluster, seconds: float, attack: Callable[[], Awaitable[Any]] | None = None
                      ) -> tuple[float, Any]:
    """Steps/s of the run over ``seconds`` (while ``attack()`` runs, if given; it is bounded by
    the same seconds), and what the attack returned."""
    first = top_step(await statuses(cluster))
    started = trio.current_time()
    out: list[Any] = []
    async with trio.open_nursery() as nursery:
        if attack is not None:
            nursery.start_soon(_append, out, attack)
        await trio.sleep(seconds)
    rate = (top_step(await statuses(cluster)) - first) / (trio.current_time() - started)
    return rate, out[0] if out else None


async def _append(out: list[Any], attack: Callable[[], Awaitable[Any]]) -> None:
    out.append(await attack())


async def _flood_cost(cluster: Cluster, seconds: float, messages: list[Any], rate: float,
                      peer: hostile.HostilePeer) -> dict[str, Any]:
    """Steps/s for ``seconds`` quiet, then while ``messages`` (signed beforehand) go out at ``rate``."""
    quiet, _ = await steps_per_s(cluster, seconds)
    flood, sent = await steps_per_s(cluster, seconds, lambda: hostile.send_paced(peer, messages, rate, seconds))
    return {"sent": sent, "bytes_each": len(messages[0].data), "steps_per_s": {"quiet": round(quiet, 2),
            "flood": round(flood, 2)}, "steps_ratio": round(flood / quiet, 3) if quiet else None}


async def _head_flood(peer: hostile.HostilePeer, cluster: Cluster, sizes: Sizes) -> dict[str, Any]:
    rate = hostile_bounds.HEAD_FLOOD_RATE
    heads = hostile_bounds.head_flood(peer, cluster.task_cid, int(rate * sizes.flood_s))
    return await _flood_cost(cluster, sizes.flood_s, heads, rate, peer)


async def _head_request_flood(peer: hostile.HostilePeer, cluster: Cluster, sizes: Sizes) -> dict[str, Any]:
    rate = hostile_bounds.HEAD_REQUEST_RATE
    requests = hostile_bounds.head_request_flood(peer, cluster.task_cid, int(rate * sizes.flood_s))
    return await _flood_cost(cluster, sizes.flood_s, requests, rate, peer)


SYBILS = 5  # as many heartbeat-only identities as issue 27's tester ran
FETCH_TIMEOUT_S = 150.0  # an outsider's `model fetch --latest`: imports, a node, the mesh, the chain, the model


@dataclass(frozen=True)
class HonestChain:
    cid: str  # the CID a head names for it (of the chain's bytes)
    model_cid: str  # its head model
    members: frozenset[str]  # every member its records name


def honest_chain(home: Path, task_cid: str) -> HonestChain:
    """A node's confirmed chain of the run (chain.jsonl, read under the task's rules)."""
    from p2ptrain.ipfs import EmbeddedStore
    from p2ptrain.protocol import Chain, ChainRules
    from p2ptrain.protocol._lineage import first_parent
    from p2ptrain.task import task_from_bytes

    store = EmbeddedStore(home)
    path = home / "tasks" / task_cid / "chain.jsonl"
    data = path.read_bytes() if path.exists() else b""
    if not data:  # none before the first checkpoint
        return HonestChain("", "", frozenset())
    task = task_from_bytes(store.cat(task_cid))
    chain = Chain.from_bytes(task_cid, first_parent(data), data, ChainRules.of(task, task_cid))
    return HonestChain(store.add_bytes(chain.to_bytes(), only_hash=True), chain.head_cid,
                       frozenset(m for s in chain.records for m in s.record.members))


def _chains_hold(cluster: Cluster, snap: dict[str, dict[str, Any]], honest: set[str]) -> dict[str, Any]:
    """Whether every node's latest model is the head of its own confirmed chain, whose records name
    only honest members: forged or poisoned latest models counted (must be 0)."""
    forged = 0
    for s in snap.values():
        chain = s.get("chain") or []
        if chain and s.get("latest_model_cid") not in (None, chain[-1]["model_cid"]):
            forged += 1
    forged += sum(1 for p in cluster.procs if honest_chain(p.home, cluster.task_cid).members - honest)
    return {"forged_or_poisoned_latest": forged, "versions": sorted({s.get("version", 0) for s in snap.values()})}


async def _heartbeat_sybils(peer: hostile.HostilePeer, cluster: Cluster, sizes: Sizes) -> dict[str, Any]:
    """Issue 27: SYBILS identities advertise the run in their heartbeats (never vote, never train)
    across at least one checkpoint; confirmed versions and steps/s against the same run just before."""
    hold = max(3 * sizes.attack_hold_s, 30.0)
    quiet, _ = await steps_per_s(cluster, sizes.flood_s)
    before = await statuses(cluster)
    planned: set[str] = set()
    out: dict[str, Any] = {}
    started = trio.current_time()
    first = top_step(before)

    async def attack() -> None:
        out.update(await hostile_bounds.heartbeat_sybils(peer, cluster.task_cid, SYBILS, hold))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(attack)
        while trio.current_time() - started < hold:
            for s in (await statuses(cluster)).values():
                planned |= set(s.get("members") or [])
            await trio.sleep(POLL_S)
    after = await statuses(cluster)
    rate = (top_step(after) - first) / (trio.current_time() - started)
    sybils = set(out.pop("identities", []))
    honest = {p.peer_id for p in cluster.procs}
    out.update(_chains_hold(cluster, after, honest), sybils=len(sybils), sybils_planned=len(planned & sybils),
               confirmed_during=min(s.get("version", 0) for s in after.values())
               - max(s.get("version", 0) for s in before.values()),
               steps_per_s={"quiet": round(quiet, 2), "sybils": round(rate, 2)},
               steps_ratio=round(rate / quiet, 3) if quiet else None)
    return out


async def _forged_latest(peer: hostile.HostilePeer, cluster: Cluster, sizes: Sizes) -> dict[str, Any]:
    """Issue 27: heads of the run at v999, one naming the honest chain's and model's CIDs (a head
    that fails verification must not hide the genuine heads with that pair) and one naming CIDs
    nobody holds, sent each second while an outsider runs `model fetch --latest` through a node."""
    with trio.fail_after(SETTLE_TIMEOUT_S):  # a confirmed model to name: the first checkpoint
        while min((s.get("version") or 0 for s in (await statuses(cluster)).values()), default=0) < 1:
            await trio.sleep(POLL_S)
    chain = await trio.to_thread.run_sync(honest_chain, cluster.procs[0].home, cluster.task_cid)
    honest_head = dataclasses.replace(
        hostile_bounds.forged_head(peer, cluster.task_cid, members=3), chain_cid=chain.cid, model_cid=chain.model_cid,
        optimizer_cid=chain.model_cid)
    heads = [honest_head, hostile_bounds.forged_head(peer, cluster.task_cid, members=3)]
    done = trio.Event()

    async def forge() -> None:
        while not done.is_set():
            for head in heads:
                await peer.publish(hostile.TASKS_TOPIC, peer.signed(head))
            with trio.move_on_after(1.0):
                await done.wait()

    outsider = cluster.base / "outsider"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(forge)
        await trio.sleep(2.0)  # the forged heads are heard before the outsider asks
        began = trio.current_time()
        fetch = await trio.to_thread.run_sync(lambda: _cli(
            "model", "fetch", "--latest", cluster.task_cid, "--home", str(outsider), "--bootstrap",
            cluster.procs[0].addr, "--output", str(cluster.base / "latest.safetensors"), "--json",
            timeout=FETCH_TIMEOUT_S))
        fetch_s = round(trio.current_time() - began, 1)
        done.set()
    after = await statuses(cluster)
    honest_models = {c["model_cid"] for s in after.values() for c in s.get("chain") or []}
    fetched = json.loads(fetch.stdout.splitlines()[-1])["model_cid"] if fetch.returncode == 0 else None
    out = _chains_hold(cluster, after, {p.peer_id for p in cluster.procs})
    out.update(fetch_exit=fetch.returncode, fetch_s=fetch_s,
               fetch_error=fetch.stderr.strip()[-200:] if fetch.returncode else None,
               outsider_got_honest_model=fetched in honest_models,
               nodes_at_v999=sum(1 for s in after.values() if (s.get("version") or 0) >= 999))
    out["forged_or_poisoned_latest"] += int(fetched is not None and fetched not in honest_models)
    return out


def piped(cmd: list[str], stdin: bool = False, log: Path | None = None) -> subprocess.Popen[str]:
    """A process whose stdout (and stdin, if asked) this one reads by lines; stderr to ``log``
    (appended) or discarded."""
    with open(log, "a") if log is not None else contextlib.nullcontext(subprocess.DEVNULL) as err:
        return subprocess.Popen(cmd, stdin=subprocess.PIPE if stdin else None, stdout=subprocess.PIPE,
                                stderr=err, text=True)


async def _serve_bodies(peer: hostile.HostilePeer, cluster: Cluster, sizes: Sizes) -> dict[str, Any]:
    """`model serve` of the run's latest model on the first node's home, under slow and big bodies."""
    snap = await statuses(cluster)
    model = next(s["latest_model_cid"] for s in snap.values() if s.get("latest_model_cid"))
    home = cluster.procs[0].home
    honest = json.dumps({"inputs": [[0.5] * 64] * 4}).encode()
    proc = piped([sys.executable, "-m", "p2ptrain.cli.main", "model", "serve", model, "--home", str(home),
                  "--listen", "127.0.0.1:0"])
    try:
        assert proc.stdout is not None
        with trio.fail_after(READY_TIMEOUT_S):  # "serving CID at URL ..."
            line = await trio.to_thread.run_sync(proc.stdout.readline, abandon_on_cancel=True)
        if " at http://" not in line:
            raise RuntimeError(f"model serve did not start: {line!r}")
        host, port = line.split(" at http://")[1].split()[0].split(":")
        base = await hostile_bounds.honest_p50(host, int(port), honest)
        big = (hostile_bounds.big_body(1024),) * 2 + (hostile_bounds.big_body(),) * 2
        seen = await hostile_bounds.slow_and_big_bodies(host, int(port), sizes.flood_s, honest, big=big)
        seen.update(baseline_p50_s=round(base, 4), p50_ratio=round(seen["honest_p50_s"] / base, 2),
                    server_alive=proc.poll() is None)
        return seen
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            await trio.to_thread.run_sync(proc.wait, STOP_TIMEOUT_S)
        if proc.poll() is None:
            proc.kill()


# In this order: the attacks that kill or wedge nodes on today's code come last, so the others run
# on a cluster that has not been through restarts.
ATTACKS: dict[str, Attack] = {
    "hostile_flood": _flood,
    "hostile_collective_hello": _hello,
    "hostile_bitswap_pinning": _bitswap,
    "hostile_fresh_identities": _fresh,  # after the others: today its thousands of peers linger
    "hostile_empty_dagpb_task": _empty,
    "hostile_control_socket": _control,
    "hostile_ts_overflow": _ts,
    "hostile_serve_bodies": _serve_bodies,
    "hostile_model_bomb": _model_bomb,  # before issue 27: +1-2 GB of RSS a node, 256 MiB kept each
    "hostile_head_request_flood": _head_request_flood,
    "hostile_head_flood": _head_flood,  # before issue 27: the run's steps/s fell to ~5% and stayed there
    "hostile_heartbeat_sybils": _heartbeat_sybils,  # before issue 27: the run froze at its next checkpoint
    "hostile_forged_latest": _forged_latest,  # before issue 27: a v999 head hid the genuine ones
    "hostile_dag_bomb_task": _bomb,  # last: today it wedges the nodes for minutes
}
# Attacks that wait on more than the nodes: an outsider's `model fetch` (a process, a node of its own).
SLOW_ATTACKS_S = {"hostile_forged_latest": FETCH_TIMEOUT_S}
# Attacks sent on pubsub to ONE node: gossipsub relays to the others before anyone decodes (issue 13, 1).
ONE_TARGET = {"hostile_ts_overflow"}


async def _watch(cluster: Cluster, victim: NodeProcess, stop: trio.Event, out: dict[str, Any]) -> None:
    """While an attack runs: peak RSS of each honest node, and `node status` latency and size on the victim."""
    peaks: dict[str, float] = {}
    latencies: list[float] = []
    sizes: list[int] = []
    members = 0
    cpu0 = cpu_s(victim)
    t0 = trio.current_time()
    while not stop.is_set():
        for p in cluster.alive():
            mb = rss_mb(p)
            if mb is not None:
                peaks[cluster.name(p)] = max(peaks.get(cluster.name(p), 0.0), mb)
        t = time.monotonic()
        answer = await call(victim, control_ops.STATUS)
        if answer is not None:
            latencies.append(time.monotonic() - t)
            sizes.append(len(json.dumps(answer)))
            members = max(members, len(answer.get("peers") or []) + len(answer.get("gone") or []))
        with trio.move_on_after(POLL_S):
            await stop.wait()
    cpu1 = cpu_s(victim)
    latencies.sort()
    out["peak_rss_mb"] = peaks
    if latencies:
        out["status_latency_s"] = {"n": len(latencies), "p50": round(latencies[len(latencies) // 2], 3),
                                   "max": round(latencies[-1], 3)}
        out["status_bytes_max"] = max(sizes)
        out["victim_membership_max"] = members
    if cpu0 is not None and cpu1 is not None:
        out["victim_cpu_pct"] = round(100 * (cpu1 - cpu0) / max(1e-3, trio.current_time() - t0), 1)


async def run_attack(cluster: Cluster, sizes: Sizes, result: Result, attack: Attack, one_target: bool) -> None:
    snap = await statuses(cluster)
    before = models_of(snap, cluster)
    victim = cluster.procs[0]
    result.detail["rss_before_mb"] = {cluster.name(p): rss_mb(p) for p in cluster.alive()}
    watch: dict[str, Any] = {}
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch, cluster, victim, stop, watch)
        try:
            async with hostile.hostile_peer() as peer:
                targets = cluster.alive()[:1] if one_target else cluster.alive()
                ids = [await peer.connect(p.addr) for p in targets]
                result.detail["attacker_connected_to"] = [cluster.name(p) for p in targets]
                await peer.wait_in_topic(hostile.MESH_TOPIC, ids)
                step = top_step(await statuses(cluster))
                started = trio.current_time()
                with trio.fail_after(sizes.attack_hold_s + sizes.flood_s + 60 + SLOW_ATTACKS_S.get(result.name, 0)):
                    result.detail["attack"] = await attack(peer, cluster, sizes)
                result.detail["attack_s"] = round(trio.current_time() - started, 2)
                await trio.sleep(EXIT_GRACE_S)
                during = await statuses(cluster)
                answering = bool(during) and not cluster.unexpected_exits()
                result.detail["steps_during_attack"] = top_step(during) - step if answering else None
        finally:
            stop.set()
    left_at = trio.current_time()
    result.detail.update(watch)
    result.detail["rss_after_mb"] = {cluster.name(p): rss_mb(p) for p in cluster.alive()}
    result.recover_s = await wait_progress(cluster, top_step(await statuses(cluster)), left_at,
                                           sizes.recover_timeout_s)
    await finish(cluster, result, before)


# ---- hostile members (3 honest nodes under robust = "clip", a hostile member in this process) ---------

MemberAttack = Callable[[Cluster, Sizes], Awaitable[dict[str, Any]]]
# A stall of the honest coordinator this long (SIGSTOP, as a machine that hangs) calls an election:
# past the election's timeout (3 heartbeats) and a few terms (3 s each) after it, for the votes.
ELECTION_PAUSE_S = 12.0
# The hostile key is the designated candidate of this many terms after the current one (4^5 keys
# tried, seconds): its arrival in the roster and the stall each start a term or two.
GROUND_TERMS = 5
# The members cluster checkpoints often: a joiner is planned at a span's end, and the scenarios
# count the versions confirmed while the hostile member is in.
MEMBERS_CHECKPOINT_INTERVAL = 10
PLANNED_TIMEOUT_S = 90.0  # from the hostile member's join until every honest node's plan lists it
OWNER_POISON = 1000.0  # what the hostile owner writes into every value of the chunk it reduces


def member_hold_s(sizes: Sizes) -> float:
    """How long a hostile member stays in the run: several checkpoints and quarantines (10 s)."""
    return max(6 * sizes.attack_hold_s, 45.0)


def log_offsets(cluster: Cluster) -> dict[str, int]:
    """Where each node's log ends now: what it logs after this is the attack's."""
    return {cluster.name(p): (p.home / "logs" / "stderr.log").stat().st_size for p in cluster.procs}


def logged_since(cluster: Cluster, offsets: dict[str, int]) -> dict[str, str]:
    """Each node's log from ``offsets`` on."""
    out = {}
    for p in cluster.procs:
        with open(p.home / "logs" / "stderr.log", "rb") as f:
            f.seek(offsets.get(cluster.name(p), 0))
            out[cluster.name(p)] = f.read().decode(errors="replace")
    return out


def chain_records(cluster: Cluster) -> dict[str, list[dict[str, Any]]]:
    """Each node's confirmed records of the run (its chain.jsonl)."""
    out = {}
    for p in cluster.procs:
        path = p.home / "tasks" / cluster.task_cid / "chain.jsonl"
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            out[cluster.name(p)] = [json.loads(line)["record"] for line in path.read_text().splitlines() if line.strip()]
    return out


def latest_accuracy(snap: dict[str, dict[str, Any]]) -> float | None:
    """The recorded test accuracy of the highest confirmed model any node holds."""
    chains = [s.get("chain") or [] for s in snap.values()]
    best = max(chains, key=len, default=[])
    return best[-1]["metrics"].get("accuracy") if best else None


async def wait_planned(cluster: Cluster, hostile_id: str) -> float | None:
    """Seconds until every honest node's plan lists the hostile member (it is then in their
    roster too), at most PLANNED_TIMEOUT_S (None)."""
    started = trio.current_time()
    while trio.current_time() - started < PLANNED_TIMEOUT_S:
        snap = await statuses(cluster)
        if len(snap) == len(cluster.alive()) and all(hostile_id in (s.get("members") or []) for s in snap.values()):
            return round(trio.current_time() - started, 1)
        await trio.sleep(POLL_S)
    return None


async def watch_run(cluster: Cluster, hostile_id: str, seconds: float, hostile_run: Any) -> dict[str, Any]:
    """For ``seconds``: the coordinators the honest nodes follow, whether the hostile member is in
    their plans, whether it coordinates (its own run says so), the versions confirmed."""
    before = await statuses(cluster)
    coordinators: set[str] = set()
    planned_polls = polls = 0
    hostile_coordinated = False
    started = trio.current_time()
    while trio.current_time() - started < seconds:
        snap = await statuses(cluster)
        polls += 1
        coordinators |= {s["coordinator"] for s in snap.values() if s.get("coordinator")}
        planned_polls += any(hostile_id in (s.get("members") or []) for s in snap.values())
        hostile_coordinated |= bool(hostile_run.status().is_coordinator)
        await trio.sleep(POLL_S)
    after = await statuses(cluster)
    return {"honest_followed_hostile": hostile_id in coordinators, "hostile_coordinated": hostile_coordinated,
            "hostile_planned_share": round(planned_polls / max(1, polls), 2),
            "confirmed_during": min((s.get("version") or 0 for s in after.values()), default=0)
            - max((s.get("version") or 0 for s in before.values()), default=0),
            "versions": sorted({s.get("version") or 0 for s in after.values()})}


def named_in_logs(logs: dict[str, str], hostile_id: str, phrase: str) -> list[str]:
    """The honest nodes whose log names the hostile member in a line with ``phrase``."""
    from p2ptrain.base import short_id

    who = short_id(hostile_id)
    return sorted(name for name, text in logs.items()
                  if any(phrase in line and who in line for line in text.splitlines()))


async def _member_coordinator(cluster: Cluster, sizes: Sizes) -> dict[str, Any]:
    """Issue 27's hostile coordinator on real processes: a member whose key is ground to be the
    designated candidate of the next terms joins the run; the honest coordinator stalls (SIGSTOP)
    long enough for an election, which the hostile member wins; its records name only itself and a
    model nobody trained, attested by itself. No honest node may confirm that model."""
    snap = await statuses(cluster)
    term = max((s.get("term") or 0 for s in snap.values()), default=0)
    honest = [p.peer_id for p in cluster.procs]
    key = await trio.to_thread.run_sync(hostile_member.attacks.ground_key, cluster.task_cid, honest,
                                        range(term + 1, term + 1 + GROUND_TERMS))
    offsets = log_offsets(cluster)
    async with hostile_member.member(cluster.base / "hostile-coordinator", [p.addr for p in cluster.alive()],
                                     key) as bad:
        hostile_id = bad.peer.node.peer_id.to_base58()
        run = await hostile_member.join(bad, cluster.task_cid)
        poison = bad.peer.content.store.add_bytes(b"weights nobody trained")
        hostile_member.attacks.forge_records(run, poison, named=1)
        planned_after_s = await wait_planned(cluster, hostile_id)
        snap = await statuses(cluster)
        coordinator, _ = member_procs(cluster, snap)
        term_at_stall = max((s.get("term") or 0 for s in snap.values()), default=0)
        boss = next((p for p in cluster.alive() if p.peer_id == coordinator), None)
        watched: list[dict[str, Any]] = []
        async with trio.open_nursery() as nursery:  # watched from before the stall: it may win at once
            nursery.start_soon(_append, watched, partial(watch_run, cluster, hostile_id, member_hold_s(sizes), run))
            if boss is not None:
                boss.proc.send_signal(signal.SIGSTOP)
                cluster.frozen.add(cluster.name(boss))
                try:
                    await trio.sleep(ELECTION_PAUSE_S)
                finally:
                    boss.proc.send_signal(signal.SIGCONT)
                    cluster.frozen.discard(cluster.name(boss))
        out = watched[0]
    logs = logged_since(cluster, offsets)
    records = chain_records(cluster)
    snap = await statuses(cluster)
    out.update(
        hostile=hostile_id, term_before=term, ground_terms=[term + 1, term + GROUND_TERMS], term_at_stall=term_at_stall,
        planned_after_s=planned_after_s, stalled=None if boss is None else cluster.name(boss),
        poisoned_confirmed=sum(1 for rs in records.values() for r in rs
                               if r["model_cid"] == poison or r["coordinator"] == hostile_id),
        poisoned_latest=sum(1 for s in snap.values() if s.get("latest_model_cid") == poison),
        refused_records={name: s.get("rejected", {}).get("record_rules", 0) for name, s in snap.items()},
        accused_by=named_in_logs(logs, hostile_id, "broke the run's rules"),
        accepted_as_coordinator_by=named_in_logs(logs, hostile_id, "accepts coordinator"),
        honest_coordinator_after=all(s.get("coordinator") in honest for s in snap.values()))
    return out


async def _member_owner(cluster: Cluster, sizes: Sizes, *, equivocate: bool) -> dict[str, Any]:
    """Issue 27's hostile owner under robust = "clip" on real processes: a member that, as a
    chunk's owner, writes OWNER_POISON into every value of the chunk it reduces, or (``equivocate``)
    sends the first node other bytes for its chunk than the rest, signed anew. It must be named
    (a verifier's check, or the members' digests), left out of later plans, the round retried
    without it, and checkpoints confirmed; accuracy against the same run's just before."""
    from libp2p.peer.id import ID

    offsets = log_offsets(cluster)
    home = cluster.base / ("hostile-equivocator" if equivocate else "hostile-owner")
    async with hostile_member.member(home, [p.addr for p in cluster.alive()]) as bad:
        hostile_id = bad.peer.node.peer_id.to_base58()
        run = await hostile_member.join(bad, cluster.task_cid)
        planned_after_s = await wait_planned(cluster, hostile_id)  # joined honestly: then it attacks
        accuracy_before = latest_accuracy(await statuses(cluster))
        rounds_before = run.status().rounds_done
        if equivocate:
            bad.owner.equivocate_to = ID.from_base58(cluster.procs[0].peer_id)
        else:
            bad.owner.poison = OWNER_POISON
        with hostile_member.attacks.installed():
            attack_started = trio.current_time()
            out = await watch_run(cluster, hostile_id, member_hold_s(sizes), run)
        # Rounds the hostile member completed while it attacked: rounds whose result every member
        # accepted, with its chunk in it (it owns one in each).
        out["hostile_rounds_completed"] = run.status().rounds_done - rounds_before
        out["attack_s"] = round(trio.current_time() - attack_started, 1)
    logs = logged_since(cluster, offsets)
    snap = await statuses(cluster)
    accuracy_after = latest_accuracy(snap)
    records = chain_records(cluster)
    # A poisoned model confirmed: a record of a span the hostile member took part in that reached a
    # checkpoint after it attacked, whose accuracy fell below half the run's just before.
    poisoned = sum(1 for rs in records.values() for r in rs
                   if hostile_id in r["members"] and accuracy_before
                   and r["metrics"].get("accuracy", 1.0) < accuracy_before / 2)
    out.update(hostile=hostile_id, planned_after_s=planned_after_s, named_by=named_in_logs(logs, hostile_id, "failed"),
               poisoned_confirmed=poisoned, accuracy_before=accuracy_before, accuracy_after=accuracy_after,
               accuracy_ratio=round(accuracy_after / accuracy_before, 3) if accuracy_before and accuracy_after else None)
    return out


MEMBER_ATTACKS: dict[str, MemberAttack] = {
    "hostile_targeted_owner": partial(_member_owner, equivocate=False),
    "hostile_equivocation": partial(_member_owner, equivocate=True),
    "hostile_coordinator": _member_coordinator,  # last: it stalls the honest coordinator
}


async def run_member_attack(cluster: Cluster, sizes: Sizes, result: Result, attack: MemberAttack) -> None:
    """A hostile member's scenario: the attack (bounded), then progress after it left, then the verdicts."""
    before = models_of(await statuses(cluster), cluster)
    started = trio.current_time()
    with trio.fail_after(member_hold_s(sizes) + hostile_member.JOIN_TIMEOUT_S + PLANNED_TIMEOUT_S + 120):
        result.detail["attack"] = await attack(cluster, sizes)
    result.detail["attack_s"] = round(trio.current_time() - started, 2)
    left_at = trio.current_time()
    await trio.sleep(EXIT_GRACE_S)
    result.recover_s = await wait_progress(cluster, top_step(await statuses(cluster)), left_at,
                                           sizes.recover_timeout_s)
    await finish(cluster, result, before)


async def settle(cluster: Cluster) -> dict[str, Any]:
    """Before a scenario: restart any node that is down (on its home, with --join), then wait
    (bounded) until every node is in the latest plan and training moves, so each scenario starts from
    a whole cluster rather than from the previous one's damage (``whole_at_start`` says if it did)."""
    started = trio.current_time()
    dead = [p for p in cluster.procs if p.proc is not None and p.proc.poll() is not None]
    if dead:
        say(f"{cluster.base.name}: restarting {', '.join(cluster.name(p) for p in dead)}")
    for p in dead:
        await cluster.restart(p, wait=False)
    everyone = {p.peer_id for p in cluster.procs}
    restarted: list[str] = []
    for attempt in range(2):
        deadline = trio.current_time() + SETTLE_TIMEOUT_S
        while trio.current_time() < deadline:
            snap = await statuses(cluster)
            plans = [set(s.get("members") or []) for s in snap.values()]
            if len(snap) == cluster.n and plans and all(everyone <= plan for plan in plans):
                step = top_step(snap)
                if await wait_progress(cluster, step, trio.current_time(), SETTLE_TIMEOUT_S / 3) is not None:
                    return {"settle_s": round(trio.current_time() - started, 1), "whole_at_start": True,
                            "restarted_unresponsive": restarted}
            await trio.sleep(POLL_S)
        if attempt == 0:
            # A node that does not even answer `node status` is wedged (an earlier attack left its
            # event loop starved): restart it, once, and give the cluster another chance.
            for p in cluster.alive():
                if await call(p, control_ops.STATUS) is None:
                    restarted.append(cluster.name(p))
                    p.kill()
                    await cluster.restart(p, wait=False)
            if not restarted:
                break
            say(f"{cluster.base.name}: restarted unresponsive {', '.join(restarted)}")
    return {"settle_s": round(trio.current_time() - started, 1), "whole_at_start": False,
            "restarted_unresponsive": restarted}


def describe(exc: BaseException) -> str:
    """One line for a scenario that raised: the first real error inside nested exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"[:500]


# ---- the run -----------------------------------------------------------------------------------------


def machine() -> str:
    cpus = os.cpu_count()
    with contextlib.suppress(OSError, ValueError):
        mem = int(Path("/proc/meminfo").read_text().split()[1]) // (1 << 20)
        return f"{platform.node()}: {cpus} CPUs, {mem} GiB, {platform.platform()}"
    return f"{platform.node()}: {cpus} CPUs"


@contextlib.contextmanager
def workdir(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    # Short paths: a control socket path must fit in 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="chaos-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def run_group(base: Path, names: list[str], sizes: Sizes, deadline: float, results: list[Result],
                    group: str) -> None:
    """One cluster (``group``: "faults", "hostile" or "members") through its scenarios in turn."""
    if not names:
        return
    n = 4 if group == "faults" else 3
    tmpfs = None
    if group == "faults" and "full_disk" in names and os.geteuid() == 0:
        tmpfs = n - 1
    extra = [*NODE_ARGS, "--accept-tasks"] if group == "hostile" else NODE_ARGS
    started = trio.current_time()
    with Cluster(base / group, n, extra, tmpfs_node=tmpfs) as cluster:
        await cluster.wait_ready(cluster.procs)
        if group == "members":
            await start_training(cluster, join_others=True, robust="clip", checkpoint=MEMBERS_CHECKPOINT_INTERVAL)
        else:
            await start_training(cluster, join_others=group != "hostile")
        say(f"cluster up in {trio.current_time() - started:.1f} s")
        for name in names:
            result = Result(name)
            results.append(result)
            if trio.current_time() > deadline:
                result.skipped = "out of time (--budget)"
                continue
            cluster.killed.clear()
            if name != "restart_same_home":
                pre = models_of(await statuses(cluster), cluster)
                result.detail.update(await settle(cluster))
                # Models lost while the bench restarted the nodes an earlier scenario killed: the
                # earlier scenario's damage, shown here, not counted in this one's lost_models.
                result.detail["lost_in_settle"] = lost_models(pre, models_of(await statuses(cluster), cluster))[0]
            say(f"{name} ...")
            t = trio.current_time()
            try:
                with trio.fail_after(max(10.0, deadline - trio.current_time() + 60)):
                    if group == "hostile":
                        await run_attack(cluster, sizes, result, ATTACKS[name], name in ONE_TARGET)
                    elif group == "members":
                        await run_member_attack(cluster, sizes, result, MEMBER_ATTACKS[name])
                    else:
                        await FAULTS[name](cluster, sizes, result)
            except Exception as exc:  # one scenario's failure is its result, not the bench's end
                result.error = describe(exc)
                result.exited = cluster.unexpected_exits()
                result.survived = not result.exited
            result.seconds = round(trio.current_time() - t, 1)
            say(f"{name}: survived={result.survived} recover_s={result.recover_s} lost={result.lost_models} "
                f"corrupt={result.corrupted_blocks} {result.skipped or ''}{result.error or ''}")


async def main_async(args: argparse.Namespace, results: list[Result]) -> None:
    sizes = QUICK if args.quick else FULL
    budget = args.budget or sizes.budget_s
    deadline = trio.current_time() + budget
    selected = lambda names: [n for n in names if not args.only or any(n.startswith(o) for o in args.only)]  # noqa: E731
    faults: list[Result] = []
    attacks: list[Result] = []
    members: list[Result] = []
    with workdir(args.workdir) as base:
        if os.geteuid() != 0 and "full_disk" in selected(FAULTS):
            say("full_disk: skipped (not root: cannot mount a tmpfs home)")
        if args.serial:
            await run_group(base, selected(FAULTS), sizes, deadline, faults, "faults")
            await run_group(base, selected(ATTACKS), sizes, deadline, attacks, "hostile")
            await run_group(base, selected(MEMBER_ATTACKS), sizes, deadline, members, "members")
        else:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(run_group, base, selected(FAULTS), sizes, deadline, faults, "faults"))
                nursery.start_soon(partial(run_group, base, selected(ATTACKS), sizes, deadline, attacks, "hostile"))
                nursery.start_soon(partial(run_group, base, selected(MEMBER_ATTACKS), sizes, deadline, members,
                                           "members"))
    results.extend(faults + attacks + members)


def table(report: dict[str, Any]) -> str:
    rows = [("scenario", "survived", "recover_s", "lost", "corrupt", "notes")]
    for s in report["scenarios"]:
        d = s["detail"]
        notes = s.get("skipped") or s.get("error") or ""
        if s.get("exited"):
            notes = f"exited: {s['exited']} " + notes
        for key in ("status_latency_s", "peak_rss_mb", "victim_cpu_pct", "status_bytes_max", "rejoined_after_sigcont_s",
                    "caught_up_after_free_s", "fetch_done_after_kill_s", "recover_each_s", "steps_lost",
                    "ready_s", "first_round_after_ready_s"):
            if key in d:
                notes += f" {key}={d[key]}"
        for key in ("steps_ratio", "p50_ratio", "honest", "blocks_kept", "confirmed_during", "sybils_planned",
                    "forged_or_poisoned_latest", "outsider_got_honest_model", "poisoned_confirmed",
                    "hostile_coordinated", "accused_by", "named_by", "hostile_planned_share",
                    "accuracy_before", "accuracy_after"):  # issue 27's attacks
            if key in d.get("attack", {}):
                notes += f" {key}={d['attack'][key]}"
        fmt = lambda v: "-" if v is None else str(v)  # noqa: E731
        rows.append((s["name"], fmt(s["survived"]), fmt(s["recover_s"]), fmt(s["lost_models"]),
                     fmt(s["corrupted_blocks"]), notes.strip()))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="each scenario once, lean sizes (<= 5 min in all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (a `scenarios` list) on stdout")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run only scenarios whose name starts with NAME (repeatable)")
    parser.add_argument("--serial", action="store_true",
                        help="run the fault cluster, then the hostile one (default: both at once, to fit the "
                        "5-minute --quick budget on a small machine; timings then share the CPU)")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="skip scenarios not started by then (default 240 with --quick, else 1800)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the nodes' homes and logs here")
    args = parser.parse_args()
    # The hostile peer's own libp2p stack logs its failed dials and teardown at ERROR: not news.
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    results: list[Result] = []
    started = time.monotonic()
    interrupted = False
    try:
        trio.run(main_async, args, results)
    except* KeyboardInterrupt:  # bare, or inside the nursery's exception group
        interrupted = True
    if interrupted:
        say("interrupted: every node process has been stopped")
        return 130
    report = {
        "command": " ".join(["bench/chaos.py", *sys.argv[1:]]),
        "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "seconds": round(time.monotonic() - started, 1),
        "scenarios": [asdict(r) for r in results],
    }
    print(json.dumps(report, indent=None if args.json else 2) if args.json else table(report))
    bad = [r for r in results if r.skipped is None and (not r.survived or r.lost_models or r.corrupted_blocks
                                                         or r.detail.get("attack", {}).get("poisoned_confirmed"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
