"""``p2ptrain model serve`` and ``model predict``: answer predictions from a model by CID over HTTP/JSON.

The model is fetched as ``model fetch`` does (the home's store, its running node, or a temporary node
with ``--bootstrap``; every byte verified against the CID) and built from the registry. Requests are
batched dynamically; see `p2ptrain docs serving`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from p2ptrain.cli.ipfs import cid_arg
from p2ptrain.cli._home_options import HOME_HELP, MODEL_HOME_HELP, home_of, model_home, source_options
from p2ptrain.base import UserError
from p2ptrain.serve import MAX_CONNECTIONS

if TYPE_CHECKING:
    from p2ptrain.serve import Server

# The input file of `model predict`: a request body, so the server's own body limit
# (serve.spec.MAX_BODY_BYTES, 8 MiB) is the useful size; the file is not read past it.
MAX_INPUT_FILE_BYTES = 8 * 1024 * 1024
# A control call to the home's node (announce, find): answered from memory at once; 10 s means the
# node is stuck.
ANNOUNCE_TIMEOUT_S = 10.0
# Announced servers `model predict` tries before it gives up: the peers announcing a CID are claims,
# and a dead or lying one costs a connection attempt each.
MAX_TRIED_SERVERS = 8
MISSING_HYPERCORN = "model serve needs hypercorn: pip install 'p2ptrain[serve]'"


def add_parsers(msub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``serve`` and ``predict`` under the ``model`` group."""

    serve = msub.add_parser("serve", help="serve a model over HTTP/JSON (POST /predict), batched", description=__doc__)
    serve.add_argument("model_cid", nargs="?", metavar="MODEL_CID", type=cid_arg,
                       help="the model to serve, by CID (or name a task with --latest instead)")
    serve.add_argument("--latest", metavar="TASK_CID", type=cid_arg,
                       help="serve the latest confirmed model of this task, swapping to each new one")
    serve.add_argument("--listen", default="127.0.0.1:8080", metavar="HOST:PORT",
                       help="where to listen (default 127.0.0.1:8080; port 0 picks a free one)")
    serve.add_argument("--max-batch", type=int, default=64, metavar="N",
                       help="samples in one forward at most (default 64; 1 turns batching off)")
    serve.add_argument("--max-wait-ms", type=float, default=5.0, metavar="T",
                       help="how long a batch waits for more requests after its first (default 5)")
    serve.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, metavar="N",
                       help=f"connections served at once (default {MAX_CONNECTIONS}); more wait to be accepted")
    serve.add_argument("--device", default="auto", help="auto (CUDA when available, else CPU), cpu, cuda or cuda:N")
    serve.add_argument("--public-url", metavar="URL", default=None,
                       help="the URL peers should use, announced on the mesh through the home's running node "
                       "(default: the listening address; a 0.0.0.0 listener is announced at this host's address)")
    source_options(serve, MODEL_HOME_HELP)
    serve.set_defaults(func=cmd_serve)

    predict = msub.add_parser("predict", help="send INPUT.json to a server of MODEL_CID; print its answer")
    predict.add_argument("model_cid", metavar="MODEL_CID", type=cid_arg,
                         help="the model whose answers you want: a server announcing this CID answers")
    predict.add_argument("input", metavar="INPUT.json", type=Path,
                         help='{"inputs": [sample, ...]} or a bare list of samples ("-": standard input)')
    predict.add_argument("--url", default=None,
                         help="the server, e.g. http://127.0.0.1:8080 (default: a peer that announced MODEL_CID on "
                         "the mesh, asked through the home's running node)")
    predict.add_argument("--home", type=Path, default=None, help=HOME_HELP)
    predict.set_defaults(func=cmd_predict)


def cmd_serve(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("hypercorn") is None:  # an optional extra
        raise UserError(MISSING_HYPERCORN)
    import trio

    from p2ptrain.services import ensure_local
    from p2ptrain.control import socket_path
    from p2ptrain.serve import open_model

    # The model is read where model_home finds it (a script's run home, as for model eval); the mesh
    # is told through the node of --home or the default home, which a run home never has.
    node_home = home_of(args)
    home, runs_looked = model_home(args, args.model_cid if args.latest is None else None)
    cids = [args.model_cid] if args.model_cid else []
    if args.public_url is not None:
        from p2ptrain.services import check_url

        try:
            check_url(args.public_url)
        except ValueError as exc:
            raise UserError(f"--public-url {exc}") from None

    def build(resolve: Callable[[], str]) -> Server:
        return open_model(
            args.model_cid, latest=args.latest, home=home, device=args.device, listen=args.listen,
            max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, max_connections=args.max_connections,
            resolve=resolve, announce=lambda cid, bound: announce(node_home, cid, args.public_url or reachable(bound)),
        )

    # --latest through --bootstrap alone: one temporary node for the server's life (serve/_temporary.py),
    # not one per lookup. Otherwise the home's store or running node (or, for a fixed CID, a temporary
    # node for the first fetch only).
    temporary = args.latest is not None and bool(args.bootstrap) and not socket_path(home).exists()
    server = None if temporary else build(
        lambda: ensure_local(home, cids, args.bootstrap, args.latest, runs_looked=runs_looked)[-1])

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nonlocal server
            if server is None:
                from p2ptrain.serve import TemporaryFollower

                follower = TemporaryFollower(home, args.bootstrap, args.latest)
                await nursery.start(follower.run)
                server = await trio.to_thread.run_sync(build, follower.latest_blocking)
            url = await nursery.start(server.run)
            following = f", following task {args.latest}" if args.latest else ""
            print(f"serving {server.batcher.current.cid} at {url}{following} (POST /predict, GET /health, GET /model)",
                  flush=True)

    trio.run(main)
    return 0


def announce(home: Path, model_cid: str, url: str) -> None:
    """Ask the home's running node to announce that ``url`` serves ``model_cid`` (UserError: no node)."""
    from p2ptrain.control import ControlClient, ops as control_ops, socket_path

    if not socket_path(home).exists():
        raise UserError(f"no node runs for {home}: start one (p2ptrain node start) to announce this server")
    ControlClient(home, timeout=ANNOUNCE_TIMEOUT_S).call(control_ops.SERVE_ANNOUNCE, model_cid=model_cid, url=url)


def reachable(bound: str) -> str:
    """The bound URL, with a wildcard host (0.0.0.0, ::) replaced by this host's address."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(bound)
    if parts.hostname not in ("0.0.0.0", "::"):
        return bound
    return f"{parts.scheme}://{socket.gethostbyname(socket.gethostname())}:{parts.port}"


def cmd_predict(args: argparse.Namespace) -> int:
    import random

    from p2ptrain.base import boundedjson
    from p2ptrain.serve import ServeError, predict

    raw = sys.stdin.buffer.read(MAX_INPUT_FILE_BYTES + 1) if str(args.input) == "-" else _read(args.input)
    doc = boundedjson.loads(raw, max_bytes=MAX_INPUT_FILE_BYTES, what=str(args.input))
    inputs = doc.get("inputs") if isinstance(doc, dict) else doc
    if not isinstance(inputs, list):
        raise UserError(f'{args.input}: expected {{"inputs": [...]}} or a list of samples')
    urls = [args.url] if args.url else _servers(args)
    random.shuffle(urls)  # spread the clients of a model over its servers
    unreachable: list[str] = []
    for url in urls:
        try:
            answer = predict(url, inputs)
        except ServeError as exc:
            if exc.status or len(urls) == 1:  # the server's own answer (bad input): another says the same
                raise
            unreachable.append(str(exc))
            continue
        if answer.get("model_cid") != args.model_cid:
            if len(urls) == 1:
                raise UserError(f"{url} serves {answer.get('model_cid')}, not {args.model_cid}")
            unreachable.append(f"{url} serves {answer.get('model_cid')}")
            continue
        print(json.dumps(answer))
        return 0
    raise UserError(f"no announced server of {args.model_cid} answered: {'; '.join(unreachable)}")


def _servers(args: argparse.Namespace) -> list[str]:
    """The URLs peers announced for ``args.model_cid``, asked through the home's running node."""
    from p2ptrain.control import ControlClient, ops as control_ops, socket_path

    home = home_of(args)
    if not socket_path(home).exists():
        raise UserError(f"give --url, or start a node for {home} (p2ptrain node start) to find servers on the mesh")
    servers = ControlClient(home, timeout=ANNOUNCE_TIMEOUT_S).call(control_ops.SERVE_FIND, model_cid=args.model_cid)
    urls = [str(s["url"]) for s in servers.get("servers", [])][:MAX_TRIED_SERVERS]
    if not urls:
        raise UserError(f"no peer has announced a server of {args.model_cid} (give --url)")
    return urls


def _read(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            return f.read(MAX_INPUT_FILE_BYTES + 1)
    except OSError as exc:
        raise UserError(f"{path}: {exc.strerror}") from None
