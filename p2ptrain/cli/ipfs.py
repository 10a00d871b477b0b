"""``p2ptrain ipfs …``: add, cat, get and pin content by CID, with the same CIDs Kubo's commands print.

Content is read from the home's store. What the store lacks is fetched first (over Bitswap, every
block verified): by the home's running node when one answers on its control socket, else, with
``--bootstrap``, by a temporary node started for this command (as ``model fetch`` does). With
``--ipfs API`` a Kubo daemon does all of it on its own network.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from p2ptrain.services import NODE_PROBE_TIMEOUT_S, fetch_progress, node_answers
from p2ptrain.base import UserError, default_home
from p2ptrain.cli._home_options import home_help
from p2ptrain.ipfs import (
    BlockMismatch,
    CID,
    ContentStore,
    ContentUnavailable,
    DagError,
    DecodeError,
    EmbeddedStore,
    InvalidCID,
    PBNode,
    PinFileError,
    RAW,
    UnixFSData,
    cid_str,
    decode_node,
    decode_unixfs,
    open_store,
    parse_cid,
    walk_dag,
)
from p2ptrain.control import ops as control_ops

# What the CLI asks of the home's running node: the same 300 s to fetch that `model fetch` asks for.
NODE_FETCH_TIMEOUT_S = 300.0
# While the node fetches, the CLI asks it how far it is this often (one small request each time).
PROGRESS_POLL_S = 0.5
# Below this a bar is noise when stderr is not a terminal (logs, CI); above it a silent minute worries.
LARGE_FILE = 256 * 1024 * 1024
CONTENT_ERRORS = (InvalidCID, BlockMismatch, ContentUnavailable, DagError, PinFileError)


def cid_arg(text: str) -> str:
    """argparse ``type`` of every CID argument: a mistyped CID is a usage error, named in one line
    (cli/main.py's parser prints no usage for a value refused) at once, before a store is opened
    or a node is asked (and never a traceback from deep inside)."""
    try:
        parse_cid(text)
    except InvalidCID as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def add_store_options(parser: argparse.ArgumentParser) -> None:
    """``--home`` and ``--ipfs``, shared by every command that reads or writes content."""
    parser.add_argument("--home", type=Path, default=None, help=home_help("node home"))
    parser.add_argument(
        "--ipfs",
        metavar="API",
        default=argparse.SUPPRESS,  # keeps a value given before the subcommand (`p2ptrain ipfs --ipfs …`)
        help="use a Kubo daemon's RPC API (e.g. http://127.0.0.1:5001) instead of the embedded store",
    )


def add_fetch_options(parser: argparse.ArgumentParser) -> None:
    """``--bootstrap``, for the commands that may fetch what the home's store lacks."""
    parser.add_argument(
        "--bootstrap", nargs="+", default=[], metavar="MULTIADDR",
        help="when no node runs for --home: start a temporary node that joins the mesh here to fetch "
             "what the store lacks (a running node for --home is used without it)",
    )


def pin_flag(text: str) -> bool:
    """Kubo's spelling of a boolean option: ``--pin=false`` (and ``--pin=true``)."""
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, not {text!r}")
    return value == "true"


def store_from_args(args: argparse.Namespace) -> ContentStore:
    if args.home is None:
        args.home = default_home()
    return open_store(args.home, ipfs_api=getattr(args, "ipfs", None))


def make_local(args: argparse.Namespace, store: ContentStore, cid: str) -> None:
    """Fetch the DAG under ``cid`` into the home's store unless it is all there already.

    Through the home's running node (its control socket answers; it fetches from every peer it is
    connected to), else through a temporary node bootstrapped from ``--bootstrap``; with neither, one
    line saying how to get either. A Kubo backend (``--ipfs``) fetches on its own, so nothing is done.
    """
    if getattr(args, "ipfs", None) or store.has(cid):
        return
    if node_answers(args.home):
        fetch_through_node(args.home, cid)
        return
    from p2ptrain.services import ensure_local

    ensure_local(args.home, [cid], args.bootstrap)  # a temporary node, or the line saying how to fetch


def fetch_through_node(home: Path, cid: str) -> None:
    """Have the home's running node fetch ``cid`` (``ipfs.fetch``), showing on stderr how far it is.

    The fetch is one request that returns when the DAG is local; meanwhile a second connection asks
    ``ipfs.progress`` every :data:`PROGRESS_POLL_S` (a node that does not know the op is not asked again).
    """
    from p2ptrain.control import ControlClient, ControlError

    done = threading.Event()
    failed: list[BaseException] = []

    def fetch() -> None:
        try:
            ControlClient(home, timeout=NODE_FETCH_TIMEOUT_S + NODE_PROBE_TIMEOUT_S).call(
                control_ops.IPFS_FETCH, cid=cid, timeout=NODE_FETCH_TIMEOUT_S)
        except BaseException as exc:  # handed to the caller's thread below
            failed.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=fetch, name=f"ipfs.fetch {cid}", daemon=True)
    thread.start()
    watcher = ControlClient(home, timeout=NODE_PROBE_TIMEOUT_S)
    with fetch_progress(f"fetch {cid[:16]}") as show:
        while not done.wait(PROGRESS_POLL_S):
            try:
                reply = watcher.call(control_ops.IPFS_PROGRESS, cid=cid)
            except ControlError:
                done.wait()  # an older node: no progress to show, only the fetch's end
                break
            except (UserError, OSError):
                continue  # progress is a courtesy: the fetch's own reply says how it went
            show(int(reply.get("bytes", 0)))
    thread.join()
    if failed:
        raise failed[0]


@contextmanager
def content_errors() -> Iterator[None]:
    """Turn the content layer's errors into one-line user errors."""
    try:
        yield
    except CONTENT_ERRORS as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:  # disk full, permissions: the user's to fix, worth one line
        raise UserError(f"{exc.filename or 'I/O'}: {exc.strerror or exc}") from None


@contextmanager
def progress_bar(desc: str, total: int | None) -> Iterator[Callable[[int], None] | None]:
    """A tqdm byte counter on stderr when someone is watching or the job is long, else nothing."""
    if not (sys.stderr.isatty() or (total or 0) >= LARGE_FILE):
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
              file=sys.stderr) as bar:
        yield bar.update


def cmd_add(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise UserError(f"{path}: not a file")
    store = store_from_args(args)
    with content_errors(), progress_bar(f"add {path.name}", path.stat().st_size) as progress:
        cid = store.add_file(path, cid_version=args.cid_version, only_hash=args.only_hash,
                             progress=progress)
        if args.pin and not args.only_hash:
            store.pin_add(cid)  # as Kubo's ipfs add: kept by repo gc until unpinned
    print(cid)
    return 0


def cmd_cat(args: argparse.Namespace) -> int:
    store = store_from_args(args)
    with content_errors():
        make_local(args, store, args.cid)
        data = store.cat(args.cid)
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    out = Path(args.output or args.cid)
    if out.is_dir():
        out = out / args.cid
    if not out.parent.is_dir():
        raise UserError(f"{out.parent}: no such directory")
    store = store_from_args(args)
    with content_errors():
        make_local(args, store, args.cid)
    with content_errors(), progress_bar(f"get {args.cid[:16]}", None) as progress:
        store.get(args.cid, out, progress=progress)
    print(f"saved {args.cid} to {out}", file=sys.stderr)
    return 0


UNIXFS_TYPES = {0: "raw", 1: "directory", 2: "file", 3: "metadata", 4: "symlink", 5: "hamt-shard"}


def embedded_from_args(args: argparse.Namespace) -> EmbeddedStore:
    """The home's embedded store, for the commands that read blocks themselves (ls, stat)."""
    store = store_from_args(args)
    if not isinstance(store, EmbeddedStore):
        raise UserError(f"ipfs {args.ipfs_command} reads the home's own store; with --ipfs ask the daemon "
                        f"(ipfs {args.ipfs_command} {args.cid})")
    return store


def root_links(store: EmbeddedStore, cid: str) -> tuple[PBNode | None, UnixFSData | None]:
    """The root block of ``cid`` decoded: (None, None) for a raw block, which has no links."""
    root = parse_cid(cid)
    data = store.block(root)
    if root.codec.name == RAW:
        return None, None
    try:
        node = decode_node(data)
        return node, decode_unixfs(node.data) if node.data is not None else None
    except DecodeError as exc:
        raise DagError(root, f"not a dag-pb node: {exc}") from None


def cmd_ls(args: argparse.Namespace) -> int:
    store = embedded_from_args(args)
    with content_errors():
        make_local(args, store, args.cid)
        node, _ = root_links(store, args.cid)
    for link in node.links if node is not None else []:  # as Kubo's ipfs ls: CID, size, name
        print(f"{cid_str(link.cid)} {link.tsize or 0} {link.name or ''}".rstrip())
    return 0


def cmd_stat(args: argparse.Namespace) -> int:
    store = embedded_from_args(args)
    with content_errors():
        make_local(args, store, args.cid)
        node, unixfs = root_links(store, args.cid)
        sizes: list[int] = []

        def measured(c: CID) -> bytes:
            data = store.block(c)
            sizes.append(len(data))
            return data

        for _ in walk_dag(parse_cid(args.cid), measured):
            pass
    if node is None:
        kind, size = "raw", sizes[0]
    else:
        kind = UNIXFS_TYPES.get(unixfs.type, "unknown") if unixfs is not None else "dag-pb"
        size = unixfs.filesize or 0 if unixfs is not None else 0
    stat = {"cid": args.cid, "type": kind, "size": size, "cumulative_size": sum(sizes), "blocks": len(sizes),
            "links": len(node.links) if node is not None else 0}
    if args.json:
        print(json.dumps(stat))
    else:  # Kubo's ipfs files stat layout
        print(f"{args.cid}\nSize: {size}\nCumulativeSize: {stat['cumulative_size']}\n"
              f"ChildBlocks: {stat['links']}\nBlocks: {len(sizes)}\nType: {kind}")
    return 0


def cmd_pin_add(args: argparse.Namespace) -> int:
    store = store_from_args(args)
    with content_errors():
        make_local(args, store, args.cid)
        store.pin_add(args.cid, recursive=args.recursive)
    print(f"pinned {args.cid} {'recursively' if args.recursive else 'directly'}")
    return 0


def cmd_pin_rm(args: argparse.Namespace) -> int:
    with content_errors():
        store_from_args(args).pin_rm(args.cid)
    print(f"unpinned {args.cid}")
    return 0


def cmd_pin_ls(args: argparse.Namespace) -> int:
    with content_errors():
        pins = store_from_args(args).pin_ls()
    for cid, kind in sorted(pins.items()):
        print(f"{cid} {kind}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = sub.add_parser("ipfs", help="add, read and pin content by IPFS CID", description=__doc__)
    group.add_argument("--ipfs", metavar="API", default=None,
                       help="for every subcommand: use a Kubo daemon's RPC API, e.g. http://127.0.0.1:5001")
    cmds = group.add_subparsers(dest="ipfs_command", metavar="SUBCOMMAND", required=True)

    p = cmds.add_parser("add", help="add a file and print its CID (the same CID as Kubo's ipfs add)")
    p.add_argument("file", metavar="FILE", help="the file to add")
    p.add_argument("-n", "--only-hash", action="store_true", help="only compute the CID, store nothing")
    # A value is required (not Kubo's bare --pin): `--pin FILE` must not read FILE as the value.
    p.add_argument("--pin", type=pin_flag, default=True, metavar="true|false",
                   help="pin it recursively (the default, as Kubo's ipfs add); --pin=false does not, "
                        "and p2ptrain repo gc may then remove it")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="the same as --pin=false")
    p.add_argument("--cid-version", type=int, choices=(0, 1), default=0,
                   help="0: CIDv0, dag-pb leaves (Kubo's default); 1: CIDv1, raw leaves")
    add_store_options(p)
    p.set_defaults(func=cmd_add)

    fetched = " (what the home's store lacks is fetched first: by its running node, else with --bootstrap)"
    p = cmds.add_parser("cat", help="write a file's bytes to stdout", description="Write a file's bytes to stdout" + fetched)
    p.add_argument("cid", metavar="CID", type=cid_arg, help="the content's CID")
    add_store_options(p)
    add_fetch_options(p)
    p.set_defaults(func=cmd_cat)

    p = cmds.add_parser("get", help="save a file (written atomically)", description="Save a file, written atomically" + fetched)
    p.add_argument("cid", metavar="CID", type=cid_arg, help="the content's CID")
    p.add_argument("-o", "--output", metavar="PATH",
                   help="file to write, or a folder to write CID into (default: ./CID)")
    add_store_options(p)
    add_fetch_options(p)
    p.set_defaults(func=cmd_get)

    p = cmds.add_parser("ls", help="list the links of a DAG's root block (CID, size, name), as Kubo's ipfs ls",
                        description="List the links of a DAG's root block: CID, size, name" + fetched)
    p.add_argument("cid", metavar="CID", type=cid_arg, help="the content's CID")
    add_store_options(p)
    add_fetch_options(p)
    p.set_defaults(func=cmd_ls)

    p = cmds.add_parser("stat", help="size, cumulative size, blocks and type of a DAG",
                        description="Size (the file's bytes), cumulative size (every distinct block's bytes), "
                                    "child links, blocks and UnixFS type of a DAG" + fetched)
    p.add_argument("cid", metavar="CID", type=cid_arg, help="the content's CID")
    p.add_argument("--json", action="store_true",
                   help="one JSON object: cid, type, size, cumulative_size, blocks, links")
    add_store_options(p)
    add_fetch_options(p)
    p.set_defaults(func=cmd_stat)

    pin = cmds.add_parser("pin", help="keep content in the local store")
    pins = pin.add_subparsers(dest="pin_command", metavar="ACTION", required=True)
    p = pins.add_parser("add", help="fetch the whole DAG and pin it", description="Pin a DAG" + fetched)
    p.add_argument("cid", metavar="CID", type=cid_arg, help="the content's CID")
    p.add_argument("--direct", dest="recursive", action="store_false", help="pin the root block only")
    add_store_options(p)
    add_fetch_options(p)
    p.set_defaults(func=cmd_pin_add)
    p = pins.add_parser("rm", help="unpin")
    p.add_argument("cid", metavar="CID", type=cid_arg, help="the content's CID")
    add_store_options(p)
    p.set_defaults(func=cmd_pin_rm)
    p = pins.add_parser("ls", help="list pins")
    add_store_options(p)
    p.set_defaults(func=cmd_pin_ls)
