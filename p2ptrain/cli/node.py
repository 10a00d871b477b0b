"""`p2ptrain node ...`: start a peer, print its ID, ask a running peer for its status."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path

from p2ptrain.cli._home_options import NODE_HOME_HELP, home_of
from p2ptrain.cli.ipfs import cid_arg
from p2ptrain.cli.config import add_setting_flags, node_config, resolve, values
from p2ptrain.base import formatter
from p2ptrain.control import NodeStatus, ops as control_ops


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    node = sub.add_parser(
        "node",
        help="run a peer and inspect it",
        description=(
            "Run a p2ptrain peer: a libp2p host (Noise-encrypted, authenticated by an Ed25519 key kept in the "
            "home) that joins the gossipsub mesh, heartbeats its capabilities, finds peers by bootstrap "
            "addresses, heartbeats, Kad-DHT and optionally mDNS, and serves an owner-only control socket."
        ),
    )
    cmds = node.add_subparsers(dest="node_cmd", metavar="SUBCOMMAND", required=True)

    start = cmds.add_parser(
        "start",
        help="run a peer until Ctrl-C or SIGTERM",
        description=(
            "Run a peer in the foreground until Ctrl-C or SIGTERM, then say goodbye to the mesh and stop "
            "cleanly. A setting not given as a flag comes from its P2PTRAIN_* environment variable, else "
            "from <home>/config.toml (which the first start writes), else its default: `p2ptrain config "
            "show` prints each with its source."
        ),
    )
    add_setting_flags(start)
    start.add_argument(
        "--accept-tasks", action="store_true",
        help="join every announced task whose requirements this node meets (default: only --join)",
    )
    start.add_argument("--join", action="append", default=[], metavar="TASK_CID", type=cid_arg,
                       help="take part in this task (repeatable)")
    start.add_argument(
        "--device", default="auto",
        help="where to train: auto (CUDA when available, else CPU), cpu, cuda or cuda:N (default auto); "
        "a task's [requirements] device comes first: a cpu task (the default) trains on the CPU",
    )
    start.add_argument(
        "--ipfs", metavar="API", default=None,
        help="keep content in this Kubo daemon (its RPC API, e.g. http://127.0.0.1:5001) instead of the "
        "embedded store; Kubo then fetches blocks on its own network",
    )
    start.add_argument(
        "--threads", type=int, default=0, metavar="N",
        help="CPU threads torch may use for training (default: torch's choice; 1 suits several "
        "peers on one small machine)",
    )
    start.add_argument(
        "--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
        help="autocast precision of the forward pass (fp16 needs CUDA; default fp32)",
    )
    start.set_defaults(func=cmd_start)

    ident = cmds.add_parser(
        "id",
        help="print the peer ID of a home (creating its identity if new)",
        description="Print the home's peer ID. No running node is needed; a new home gets a new Ed25519 identity.",
    )
    ident.add_argument("--home", type=Path, default=None, help=NODE_HOME_HELP)
    ident.set_defaults(func=cmd_id)

    status = cmds.add_parser(
        "status",
        help="show a running peer's addresses, connections, topics and the peers it hears",
        description=(
            "Ask the node running for this home (through its control socket) for its peer ID, listen "
            "addresses, connected peers, mesh topics, and each peer's last heartbeat and capabilities."
        ),
    )
    status.add_argument("--home", type=Path, default=None, help=NODE_HOME_HELP)
    status.add_argument("--json", action="store_true", help="print one JSON object (keys peer_id, addrs, peers, ...)")
    status.set_defaults(func=cmd_status)


def cmd_id(args: argparse.Namespace) -> int:
    from p2ptrain.base import load_or_create_identity, peer_id_of

    print(peer_id_of(load_or_create_identity(home_of(args))).to_base58())
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    from p2ptrain.base import use_one_arena

    use_one_arena()  # before any thread allocates (see p2ptrain/base/_malloc.py)
    import trio

    from p2ptrain.base import short_id
    from p2ptrain.node import Node

    resolved = resolve(args)  # flags, P2PTRAIN_* environment, config.toml, defaults
    settings = values(resolved)
    metrics_at = None
    if settings["metrics"] is not None:
        from p2ptrain.services import MetricsServer, parse_address

        source = next(s.source for s in resolved if s.name == "metrics").split()[-1]
        what = source if source.startswith("--") else f"${source}"
        metrics_at = parse_address(settings["metrics"], what)  # a typo is one line, before anything starts
    # The bootstrap addresses first (libp2p, a second or so), then what imports torch (the device
    # check, the task service: ~8 s on a loaded machine): a typo fails at once, and before the
    # node makes its home.
    from p2ptrain.mesh import parse_bootstrap

    for addr in settings["bootstrap"]:
        parse_bootstrap(addr)
    from p2ptrain.net import check_listen
    from p2ptrain.control import socket_path

    if not socket_path(Path(settings["home"])).exists():  # else this home's node may run: the node says so
        # The node checks this itself (Node._live), after torch is imported (~8 s): say it at once.
        check_listen(settings["listen"])
    _check_device(args.device)
    node = Node(settings["home"], node_config(resolved))
    from p2ptrain.services import TaskOptions, make_peer

    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    peer = make_peer(node, TaskOptions(accept_tasks=args.accept_tasks, join=args.join, device=args.device,
                                       precision=args.precision), ipfs_api=args.ipfs)
    if metrics_at is not None:
        node.add_service(MetricsServer(peer, *metrics_at).run, name="metrics")
    _log_to_home(node.home, settings["log_format"])
    if args.verbose < 2:
        # py-libp2p logs every refused redial of a stopped peer at ERROR; our discovery already
        # reports reachability at DEBUG, so keep its churn out of the node's log.
        logging.getLogger("libp2p").setLevel(logging.CRITICAL)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signal, node)
            await node.run()
            nursery.cancel_scope.cancel()

    async def _stop_on_signal(node: Node) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                logging.getLogger(__name__).info("node %s got %s: stopping", short_id(node.peer_id), signal.Signals(signum).name)
                node.stop()

    trio.run(main)
    return 0


def _log_to_home(home: Path, log_format: str) -> None:
    """Node lifecycle lines at INFO to stderr and to <home>/logs/node.log."""
    handler = logging.FileHandler(home / "logs" / "node.log")
    handler.setFormatter(formatter(log_format))
    ours = logging.getLogger("p2ptrain")
    ours.addHandler(handler)
    if ours.getEffectiveLevel() > logging.INFO:
        ours.setLevel(logging.INFO)


def cmd_status(args: argparse.Namespace) -> int:
    from p2ptrain.control import ControlClient

    status = NodeStatus.from_json(ControlClient(home_of(args)).call(control_ops.STATUS))
    if args.json:
        json.dump(status.to_json(), sys.stdout, indent=2)
        print()
        return 0
    print(_render(status))
    return 0


def _gib(n: int | None) -> str:
    return "?" if not n else f"{n / 2**30:.1f} GiB"


def _render(s: NodeStatus) -> str:
    lines = [f"peer   {s.peer_id}", "addrs"]
    lines += [f"  {a}" for a in s.addrs]
    lines.append(f"topics {', '.join(s.topics) or '-'}")
    lines.append(f"connected to {len(s.connected)} peer(s)")
    lines.append(f"peers  {s.peers_total} alive, {s.gone_total} gone")
    for p in s.peers + s.gone:
        c = p["caps"]
        device = c["device"] + (f" {c['gpu_name']} {_gib(c['gpu_memory_bytes'])}" if c.get("gpu_name") else "")
        state = "alive" if p["alive"] else f"gone ({p['left_reason']})"
        lines.append(
            f"  {p['peer_id']}  {state:<10} heartbeat {p['last_heartbeat_age_s']:.1f} s ago  "
            f"{device}, {c['cpu_count']} CPU, {_gib(c['free_ram_bytes'])} free RAM, v{c['version']}"
        )
        if c.get("arithmetic"):  # members of one run must compute the same bits (docs/deploy.md)
            lines.append(f"    arithmetic: {c['arithmetic']}")
        packaged = [b for b in c.get("builders", []) if ":" in b]  # builders of installed packages
        if packaged:
            more = f" and {len(packaged) - 6} more" if len(packaged) > 6 else ""
            lines.append(f"    builders from packages: {', '.join(packaged[:6])}{more}")
    dropped = s.messages.get("dropped", {})
    if dropped:
        lines.append("dropped messages: " + ", ".join(f"{k} {v}" for k, v in sorted(dropped.items())))
    return "\n".join(lines)


def _check_device(device: str) -> None:
    """``--device`` as the trainer will resolve it, now: a typo or a missing GPU is one line at
    start, not a failed task run later."""
    from p2ptrain.training import resolve_device

    resolve_device(device)  # a DeviceError: cli/main.py names --device
