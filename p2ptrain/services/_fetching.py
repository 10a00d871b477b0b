"""Content by CID made local for a command or a call that needs it: from the home's store, else
through the home's running node, else through a temporary node that joins the mesh by
``--bootstrap`` for this one job (``model fetch``, ``model eval``, ``model serve``, ``model
verify``, ``ipfs get``, :func:`p2ptrain.load_state`, :func:`p2ptrain.load_model`). Every byte is verified against its CID on the
way in; a fetch whose size is not known shows how far it is on stderr."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from p2ptrain.base import ArgumentError, UserError, default_home
from p2ptrain.control import TaskStatus, ops as control_ops

if TYPE_CHECKING:
    from p2ptrain.ipfs import ContentStore
    from p2ptrain.protocol import Chain
    from p2ptrain.services._peer import Fetcher
    from p2ptrain.wire import ModelRecord, TaskHead

# How long a temporary node waits for its first peer, and for the latest head of a task.
EPHEMERAL_MESH_TIMEOUT_S = 20.0
# A node that does not answer a ping this fast is stuck, not running usefully (or a killed one left its socket file).
NODE_PROBE_TIMEOUT_S = 5.0
# Off a terminal (a log, CI) a fetch in flight says how far it is this often: a long fetch is seen
# moving, a short one prints nothing.
PROGRESS_LINE_S = 10.0
# Scripts' run homes (HOME/runs/*) looked through for a run's chain, at most (one directory listing).
MAX_RUN_HOMES = 256


@contextmanager
def fetch_progress(desc: str) -> Iterator[Callable[[int], None]]:
    """``show(bytes_so_far)`` for a fetch whose size is not known: a live counter on a terminal,
    else a line on stderr every :data:`PROGRESS_LINE_S` (stdout stays the content's, for ``cat``)."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        with tqdm(desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False, file=sys.stderr) as bar:
            def update(n: int) -> None:
                bar.update(n - bar.n)

            yield update
        return
    next_line = time.monotonic() + PROGRESS_LINE_S

    def line(n: int) -> None:
        nonlocal next_line
        if time.monotonic() >= next_line:
            next_line += PROGRESS_LINE_S
            print(f"{desc}: {n / 2**20:.1f} MiB so far", file=sys.stderr, flush=True)

    yield line


def node_answers(home: Path) -> bool:
    """Whether a node runs for ``home``: the rule is that its control socket answers a ping (a
    socket file left by a crashed node does not)."""
    from p2ptrain.control import ControlClient, ControlError

    try:
        ControlClient(home, timeout=NODE_PROBE_TIMEOUT_S).call(control_ops.PING)
    except ControlError:
        raise  # something answered, and failed: say so rather than start a second node on the home
    except UserError:
        return False
    return True


def ensure_local(
    home: Path, cids: list[str], bootstrap: list[str], latest: str | None = None,
    then: Callable[[ContentStore], list[str]] | None = None, *, runs_looked: bool = False,
) -> list[str]:
    """Make ``cids`` (plus the latest model of task ``latest``) local; return the CIDs in that order.

    ``then(store)`` names more CIDs once the first ones are local (a dataset split's shards, read
    from its manifest); they are fetched in the same session, as are the stage files of a CID that
    is a pipelined run's model manifest. ``runs_looked``: no home was given, and :func:`home_holding`
    found the CID in no run home under ``home`` either; the error for content that is nowhere says
    so: it named ``~/.p2ptrain`` alone, where the user's scripts keep their runs' models in
    ``~/.p2ptrain/runs/*``.
    """
    from p2ptrain.ipfs import open_store
    from p2ptrain.control import ControlClient, ControlError, socket_path

    store = open_store(home)
    if latest is None and all(store.has(c) for c in cids):
        more = _more(store, cids, then)
        if all(store.has(c) for c in more):
            return cids
    if socket_path(home).exists() and node_answers(home):  # not the socket file a killed process left
        client = ControlClient(home, timeout=600.0)
        try:
            status = None
            if latest is not None:
                status = TaskStatus.from_json(
                    client.call(control_ops.TASK_STATUS, task_cid=latest, timeout=EPHEMERAL_MESH_TIMEOUT_S))
                cids = cids + [_latest_from_status(status, latest)]
            for cid in cids:
                client.call(control_ops.IPFS_FETCH, cid=cid, timeout=300.0)
            for cid in _more(store, cids, then):
                client.call(control_ops.IPFS_FETCH, cid=cid, timeout=300.0)
            if status is not None and status.chain_cid:  # the chain the node verified: its last record
                client.call(control_ops.IPFS_FETCH, cid=status.chain_cid, timeout=300.0)
                _check_stages(store, _last_record(store, status.chain_cid, cids[-1]))
            return cids
        except ControlError as exc:
            raise UserError(str(exc)) from None
        except UserError:
            if not bootstrap:
                raise
    if not bootstrap:
        kept = _latest_kept(home, latest) if latest is not None else None
        if kept is not None and all(store.has(c) for c in [*cids, kept, *_more(store, [*cids, kept], then)]):
            return cids + [kept]
        missing = ([c for c in cids + _more(store, [c for c in cids if store.has(c)], None) if not store.has(c)]
                   or [f"latest model of {latest}"])
        runs = _run_homes_keeping(home, latest) if latest is not None else []
        looked = len(_run_homes(home)) if runs_looked else 0
        raise ArgumentError(
            "{missing} not in the store of {home_path}"
            + (" nor in its {looked} run home(s) ({home_path}/runs/*)" if looked else "")
            + ", and no node is running there: start one "
            "(p2ptrain node start --home {home_path} --bootstrap ...) or pass {bootstrap:MULTIADDR}"
            + ("; a run's home on this machine keeps its chain: {home:{kept}}" if runs else ""),
            missing=", ".join(missing), home_path=home, looked=looked, kept=runs[0] if runs else None)
    return _fetch_with_ephemeral_node(home, cids, bootstrap, latest, then)


def _run_homes(home: Path) -> list[Path]:
    """The homes of scripts' runs under ``home`` (``p2ptrain.Optimizer``'s default homes,
    ``HOME/runs/*``), in name order, at most :data:`MAX_RUN_HOMES` (one directory listing)."""
    runs = home / "runs"
    return sorted(p for p in runs.iterdir() if p.is_dir())[:MAX_RUN_HOMES] if runs.is_dir() else []


def home_holding(cid: str) -> Path:
    """The default home, or the first run home under it (``Optimizer``'s default) holding ``cid``,
    else the default home: where ``load_state``, ``load_model`` and ``model fetch``, ``eval``,
    ``export`` and ``verify`` look when given no home, so a model a script's run just confirmed is
    found where its members kept it (pass ``runs_looked=True`` to :func:`ensure_local` with it)."""
    from p2ptrain.ipfs import open_store

    base = default_home()
    for home in [base, *_run_homes(base)]:
        if (home / "blocks").is_dir() and open_store(home).has(cid):
            return home
    return base


def _run_homes_keeping(home: Path, task_cid: str) -> list[Path]:
    """The run homes under ``home`` that keep ``task_cid``'s chain: after a script's run, ``model
    fetch --latest RUN_CID`` on the default home found nothing, with no word of where the run's
    members kept it."""
    from p2ptrain.run import RunDir

    return [h for h in _run_homes(home) if RunDir.of(h, task_cid).chain.is_file()]


def _more(store: ContentStore, cids: list[str], then: Callable[[ContentStore], list[str]] | None) -> list[str]:
    """What is fetched once ``cids`` are local: ``then``'s CIDs and the stage files of every
    model manifest among ``cids``."""
    from p2ptrain.training import stage_file_cids

    return (then(store) if then else []) + [part for cid in cids for part in stage_file_cids(store, cid)]


def _latest_kept(home: Path, task_cid: str) -> str | None:
    """The last model of the chain ``home`` keeps of ``task_cid`` (a member's home, after the run or
    with its node stopped), said on stderr since the mesh may hold a later one; None if none."""
    from p2ptrain.protocol import RecordError, chain_lines, entry_from_bytes
    from p2ptrain.run import RunDir

    run = RunDir.of(home, task_cid)
    try:
        lines = chain_lines(run.read_chain() or b"") if run.chain.is_file() else []
        record = entry_from_bytes(lines[-1]).signed.record if lines else None
    except (OSError, RecordError):
        return None
    if record is None:
        return None
    print(f"latest model of task {task_cid} in this home's chain: v{record.version} (step {record.step}); the "
          "mesh may hold a later one (--bootstrap MULTIADDR asks it)", file=sys.stderr)
    return record.model_cid


def _latest_from_status(status: TaskStatus, task_cid: str) -> str:
    cid = status.latest_model_cid
    if not cid or not status.version:
        raise UserError(f"task {task_cid} has no confirmed model yet (state: {status.state})")
    return cid


def _fetch_with_ephemeral_node(
    home: Path, cids: list[str], bootstrap: list[str], latest: str | None,
    then: Callable[[ContentStore], list[str]] | None,
) -> list[str]:
    import trio

    out = list(cids)

    async def work(peer: Fetcher) -> None:
        if latest is not None:
            # Any member of a run (under way or over) answers; the chain is verified.
            _, chain = await find_latest(peer, latest)
            out.append(chain.head_cid)
        for cid in out:
            await fetch_through(peer, cid)
        more = await trio.to_thread.run_sync(_more, peer.content.store, out, then)
        for cid in more:
            await fetch_through(peer, cid)
        if latest is not None and chain.records:
            _check_stages(peer.content.store, chain.records[-1].record)

    with_ephemeral_node(home, bootstrap, work)
    return out


def _check_stages(store: ContentStore, record: ModelRecord) -> None:
    """The latest model of a pipelined run: each stage's files signed by a quorum of its replicas
    (its manifest carries them; a verified chain proves the record, not yet its stages)."""
    from p2ptrain.training import stage_signatures_problem

    problem = stage_signatures_problem(store, record)
    if problem is not None:
        raise UserError(f"the latest model of task {record.task_cid} is refused: {problem}")


def _last_record(store: ContentStore, chain_cid: str, model_cid: str) -> ModelRecord:
    """The record of ``model_cid``, the last of the chain ``chain_cid`` a node verified."""
    from p2ptrain.protocol import MAX_CHAIN_BYTES, chain_lines, parse_entry

    record = parse_entry(chain_lines(store.cat(chain_cid, max_bytes=MAX_CHAIN_BYTES))[-1]).signed.record
    if record.model_cid != model_cid:
        raise UserError(f"the node's chain {chain_cid} does not end with model {model_cid}")
    return record


async def fetch_through(peer: Fetcher, cid: str) -> None:
    """One CID through a temporary node, showing on stderr how far it is (as through a node)."""
    import trio

    if await trio.to_thread.run_sync(peer.content.store.has, cid):
        return
    with fetch_progress(f"fetch {cid[:16]}") as show:
        await peer.content.fetch(cid, timeout=300.0, progress=show)


async def find_latest(peer: Fetcher, task_cid: str) -> tuple[TaskHead, Chain]:
    """The latest verified ``(head, chain)`` of ``task_cid`` through a temporary node, within
    EPHEMERAL_MESH_TIMEOUT_S (a UserError line naming what was refused otherwise)."""
    import trio

    from p2ptrain.services._latest import LatestFinder

    finder = LatestFinder(peer.node, peer.content, task_cid)
    try:
        with trio.fail_after(EPHEMERAL_MESH_TIMEOUT_S):
            found = await finder.find()
    except trio.TooSlowError:
        refused = dict(finder.refused)
        raise UserError(f"no peer told us the latest model of task {task_cid} within {EPHEMERAL_MESH_TIMEOUT_S:.0f} s"
                        + (f" (heads refused: {refused})" if refused else "")) from None
    if finder.refused["fork"]:
        print(f"warning: peers hold verified chains of task {task_cid} that fork; took the longest "
              f"(v{found[1].version}). See `p2ptrain docs security` (open admission).", file=sys.stderr)
    return found


def with_ephemeral_node(home: Path, bootstrap: list[str], work: Callable[[Fetcher], Awaitable[None]]) -> None:
    """Run ``await work(peer)`` on a temporary node of ``home`` that joins the mesh through
    ``bootstrap`` (its first peer within EPHEMERAL_MESH_TIMEOUT_S), then stop it."""
    import trio

    from p2ptrain.ipfs import ContentUnavailable
    from p2ptrain.node import Node, NodeConfig
    from p2ptrain.services._peer import make_fetcher

    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    node = Node(home, dataclasses.replace(NodeConfig.of_home(home), listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=bootstrap))
    peer = make_fetcher(node)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            try:
                with trio.move_on_after(EPHEMERAL_MESH_TIMEOUT_S):
                    # py-libp2p has no event for a new connection: poll.
                    while not node.host or not node.host.get_connected_peers():  # noqa: ASYNC110
                        await trio.sleep(0.1)
                if not node.host or not node.host.get_connected_peers():
                    raise UserError(f"no peer reachable through {bootstrap[0]}")
                await work(peer)
            except ContentUnavailable as exc:
                raise UserError(str(exc)) from None
            finally:
                node.stop()

    trio.run(main)


def split_shards(store: ContentStore, manifest_cid: str, split: str) -> list[str]:
    """The shard CIDs of one split of a dataset whose manifest is local."""
    from p2ptrain.data import Manifest

    manifest = Manifest.load(store, manifest_cid)
    if split not in manifest.splits:
        raise UserError(f"dataset {manifest_cid} has no split {split!r} (it has {', '.join(manifest.splits)})")
    return [ref.cid for ref in manifest.shards(split)]
