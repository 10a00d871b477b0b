"""``p2ptrain repo …``: check and clean a home's block store.

``verify`` reads every block and lists those whose bytes no longer hash to their name (disk rot, a
hand-edited file, a half-copied home); it only reads, so it is safe next to a running node.

``gc`` removes the blocks nothing this home keeps reaches: not a pin (``ipfs pin ls``), not a task
the node took part in (its task file, dataset, initial model, every confirmed checkpoint of its
chain). It refuses to run while a node runs for the home, because a running node stores blocks
before anything names them (a checkpoint being written, a fetch in flight) and a collection then
would delete them. While it runs it holds the pin lock, and it never removes a block written (or
stored again) after it began, so a CLI command adding content meanwhile keeps its blocks.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from p2ptrain.cli._home_options import home_help, home_of
from p2ptrain.cli.ipfs import content_errors
from p2ptrain.base import UserError

# How long connecting to the home's control socket may take before the node is taken for gone.
SOCKET_PROBE_TIMEOUT_S = 2.0


def _store(home: Path) -> Any:
    from p2ptrain.ipfs import EmbeddedStore

    if not (home / "blocks").is_dir():
        raise UserError(f"{home} has no block store ({home / 'blocks'} does not exist)")
    return EmbeddedStore(home)


@contextmanager
def _progress(what: str, total: int) -> Iterator[Callable[[int], None]]:
    """Blocks done so far on stderr: redrawn in place on a terminal, else a line per tenth."""
    done = [0]
    step = max(1, total // 10)
    tty = sys.stderr.isatty()

    def update(n: int) -> None:
        done[0] += n
        if tty:
            print(f"\r{what}: {done[0]}/{total} blocks", end="", file=sys.stderr, flush=True)
        elif done[0] % step == 0 or done[0] == total:
            print(f"{what}: {done[0]}/{total} blocks", file=sys.stderr, flush=True)

    yield update
    if tty:
        print(file=sys.stderr)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cmd_verify(args: argparse.Namespace) -> int:
    home = home_of(args)
    store = _store(home)
    total = sum(1 for _ in store.blocks.block_files())
    with content_errors(), _progress("verify", total) as progress:
        bad = list(store.blocks.verify(progress))
    if args.json:
        print(json.dumps({"blocks": total, "bad": [
            {"cid": b.cid, "path": str(b.path), "reason": b.reason} for b in bad]}))
    else:
        for b in bad:
            print(f"{b.cid or '-'}  {b.path}  {b.reason}")
        print(f"verified {total} blocks in {store.blocks.root}: {len(bad)} bad"
              + (" (fetch them again: p2ptrain ipfs pin add CID, or let the node refetch)" if bad else ""))
    return 1 if bad else 0


def _node_running(home: Path) -> bool:
    """Whether a node answers on the home's control socket (a stale socket file does not count)."""
    from p2ptrain.control import socket_path

    path = socket_path(home)
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(SOCKET_PROBE_TIMEOUT_S)
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def cmd_gc(args: argparse.Namespace) -> int:
    from p2ptrain.ipfs import DIRECT, CorruptBlock

    home = home_of(args)
    store = _store(home)
    if _node_running(home):
        raise UserError(
            f"a node is running for home {home}; stop it before repo gc (a running node stores blocks "
            "before anything names them, and gc would delete them)"
        )
    from p2ptrain.run import RunDir

    started = time.time()
    with content_errors(), store.blocks.gc_lock():
        pins = store.blocks.pin_ls()
        tasks: dict[str, list[str]] = {}
        if RunDir.runs(home):  # reading runs imports torch and libp2p: after the refusal, and only if any
            from p2ptrain.services import run_state_roots

            tasks = run_state_roots(home, store)
        recursive = [cid for cid, kind in pins.items() if kind != DIRECT]
        recursive += [cid for cids in tasks.values() for cid in cids]
        direct = [cid for cid, kind in pins.items() if kind == DIRECT]
        try:
            keep = store.reachable(recursive, direct)
        except CorruptBlock as exc:
            raise UserError(f"{exc}; nothing was removed: fetch it again, then run gc") from None
        total = sum(1 for _ in store.blocks.block_files())
        with _progress("gc" + (" (dry run)" if args.dry_run else ""), total) as progress:
            sweep = store.blocks.sweep(keep, started, dry_run=args.dry_run, progress=progress)
    if args.json:
        print(json.dumps({
            "dry_run": args.dry_run, "removed": sweep.removed, "removed_bytes": sweep.removed_bytes,
            "kept": sweep.kept, "kept_bytes": sweep.kept_bytes, "pins": len(pins), "tasks": len(tasks),
            "removed_cids": sweep.removed_cids,
        }))
    else:
        verb = "would remove" if args.dry_run else "removed"
        print(f"gc: {verb} {sweep.removed} blocks ({_mib(sweep.removed_bytes)}), kept {sweep.kept} "
              f"({_mib(sweep.kept_bytes)}) reached from {len(pins)} pins and {len(tasks)} tasks")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = sub.add_parser("repo", help="verify and garbage-collect a home's block store")
    cmds = group.add_subparsers(dest="repo_command", metavar="SUBCOMMAND", required=True)

    p = cmds.add_parser(
        "verify",
        help="check that every block hashes to its CID; exit 1 if any does not",
        description=(
            "Read every block of the home's store and check that its bytes hash to the CID its file "
            "is named by. Lists the bad ones (CID, file, why) and exits 1 if there are any, 0 if the "
            "store is clean. Read-only: safe while a node runs. A bad block is quarantined and "
            "fetched again the next time something reads it."
        ),
    )
    p.add_argument("--home", type=Path, default=None, help=home_help("node home"))
    p.add_argument("--json", action="store_true", help='print one JSON object {"blocks": N, "bad": [...]}')
    p.set_defaults(func=cmd_verify)

    p = cmds.add_parser(
        "gc",
        help="remove blocks no pin and no task's state reaches",
        description=(
            "Remove every block that nothing this home keeps reaches: pins (p2ptrain ipfs pin ls), "
            "and for each task under HOME/tasks its task file, dataset manifest and shards, initial "
            "model, and every confirmed model and optimizer state in its chain.jsonl. Unpinned "
            "content (e.g. added with --no-pin, or fetched for a one-off model eval) is removed. "
            "Refuses while a node runs for the home (stop it first); holds the pin lock while it "
            "runs and never removes a block written after it started. Nothing is removed if a "
            "reachable block is corrupt or a task's state cannot be read."
        ),
    )
    p.add_argument("--home", type=Path, default=None, help=home_help("node home"))
    p.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object {removed, removed_bytes, kept, kept_bytes, pins, tasks, ...}")
    p.set_defaults(func=cmd_gc)
