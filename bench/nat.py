"""What NAT costs a training run: the demo task trained by 4 `p2ptrain node start` processes, each
in its own namespace behind a ``--rate`` link, all public, against the same with two members
behind two different emulated NATs (p2ptrain.testing._nat; the two public peers run
``--relay-service``): routers that answer unsolicited packets with a reset (``two_behind_nat``:
the private pair reaches each other only through a relay; hole punching cannot work), and routers
that drop them like home routers' firewalls (``two_behind_firewalled_nat``: the pair meets through
a relay, then hole punching connects it directly). Needs root.

    python bench/nat.py --rate 100mbit --steps 40 --json
    python bench/nat.py --rate 100mbit --only-streams --stream-mib 32    # relayed vs direct, one stream

Streams (``streams``): one stream of ``--stream-mib`` MiB between two public peers (direct) and
between two private peers behind different NATs (through a third public peer's relay), every link
at ``--rate``: seconds, MB/s, and the bytes the relay forwarded (Noise and yamux overhead included).

Per layout: ``run_s`` (task published to every member done), ``steps_per_s`` (steps / run_s),
``sync_s`` (members' mean time in the gradient exchange), ``relayed_bytes`` (what the relays
forwarded), and for the NAT layouts ``private_pairs_direct`` (of the private pairs behind
different NATs, how many are directly connected when the run ends, as "n/m"), ``private_ready_s`` (a private node's
process start to: knows it
is private, holds relay slots and is connected to all others) and ``first_round_s`` (publish to
the private members' first round). ``ratio``: NAT steps/s over all-public steps/s
(``ratio_firewalled``: the same for the firewalled NATs). One run each, on
a loaded 2-core box: compare within a run, not across machines.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from p2ptrain.base import UserError, short_id
from p2ptrain.node import NODE_ARGS
from p2ptrain.control import ControlClient, ops as control_ops
from p2ptrain.testing import emulated_nat, emulated_wan, nat_unavailable, wait_for, wan_node_processes
from p2ptrain.task import TASK_TEMPLATE

CLI_TIMEOUT_S = 180.0
MESH_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 900.0
POLL_S = 0.2


def task_status(home: Path, task_cid: str) -> dict | None:
    try:
        return ControlClient(home, timeout=10).call(control_ops.TASK_STATUS, task_cid=task_cid)
    except (UserError, OSError):
        return None


def train(procs: list, steps: int, private: list[int]) -> dict:
    home = procs[0].home
    done = subprocess.run([sys.executable, "-m", "p2ptrain.cli.main", "dataset", "add", "sklearn:digits", "--shards",
                           str(len(procs)), "--home", str(home)], capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
                          check=True)
    manifest = done.stdout.strip().splitlines()[-1]
    text = TASK_TEMPLATE.format(manifest=manifest, steps=steps, checkpoint=steps, density=0.01, peers=len(procs))
    started = time.monotonic()
    task_cid = ControlClient(home, timeout=120).call(control_ops.TASK_PUBLISH, text=text, join=True)["task_cid"]
    first_round: dict[int, float] = {}
    deadline = started + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        statuses = [task_status(p.home, task_cid) for p in procs]
        for i in private:
            if i not in first_round and statuses[i] and (statuses[i].get("rounds_done") or 0) >= 1:
                first_round[i] = time.monotonic() - started
        if all(s and s["state"] == "done" for s in statuses):
            break
        time.sleep(POLL_S)
    else:
        raise TimeoutError(f"the run did not finish in {RUN_TIMEOUT_S} s")
    run_s = time.monotonic() - started
    relayed = sum((p.status().get("relay") or {}).get("relayed_bytes", 0) for p in procs)
    return {
        "run_s": round(run_s, 2), "steps_per_s": round(steps / run_s, 3),
        "sync_s": round(sum(s["sync_s"] for s in statuses) / len(statuses), 3),
        "rounds": statuses[0]["rounds_done"], "bytes_sent": sum(s["bytes_sent"] for s in statuses),
        "relayed_bytes": relayed,
        "first_round_s": {str(i): round(t, 2) for i, t in first_round.items()},
    }


def all_public(args: argparse.Namespace, base: Path) -> dict:
    with emulated_wan(4, args.rate) as wan, wan_node_processes(wan, base, extra_args=NODE_ARGS) as procs:
        wait_for(lambda: all(len(p.status()["connected"]) >= 3 for p in procs), MESH_TIMEOUT_S)
        return train(procs, args.steps, [])


def two_behind_nat(args: argparse.Namespace, base: Path, firewall: bool = False) -> dict:
    with emulated_nat(public=2, lans=[1, 1], rate=args.rate, firewall=firewall) as net:
        started = time.monotonic()
        with wan_node_processes(net, base, extra_args=[*NODE_ARGS, "--relay-service"]) as procs:
            ready: dict[int, float] = {}

            def settled() -> bool:
                for i in (2, 3):
                    s = procs[i].status()
                    if i not in ready and s["reachability"] == "private" and s["relay"]["reserved_on"] \
                            and len(s["connected"]) >= 3:
                        ready[i] = time.monotonic() - started
                return len(ready) == 2

            wait_for(settled, MESH_TIMEOUT_S, interval=POLL_S)
            out = train(procs, args.steps, [2, 3])
            a, b = procs[2].status(), procs[3].status()
            direct = b["peer_id"] in a["connected"] and short_id(b["peer_id"]) not in a["relay"]["relayed_peers"]
            out["private_pairs_direct"] = f"{int(direct)}/1"
            out["punched"] = sum(s["relay"].get("punched", 0) for s in (a, b))
            out["private_ready_s"] = {str(i): round(t, 2) for i, t in ready.items()}
            return out


STREAM = str(Path(__file__).resolve().parent / "nat_stream.py")
LINE_TIMEOUT_S = 120.0


def _line(proc: subprocess.Popen, want: str) -> dict:
    """The next JSON line of ``proc`` whose event is ``want`` (bounded by LINE_TIMEOUT_S)."""
    deadline = time.monotonic() + LINE_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{proc.args[-3:]} exited: {proc.stderr.read()[-2000:]}")
        event = json.loads(line)
        if event["event"] == want:
            return event
    raise TimeoutError(f"no {want} from {proc.args}")


def streams(args: argparse.Namespace) -> dict:
    """One stream of --mib MiB: between two public peers (direct), then between two private peers
    behind different NATs (through a third public peer's relay); every link at --rate."""
    with emulated_nat(public=3, lans=[1, 1], rate=args.rate) as net:
        def role(peer, *argv: str) -> subprocess.Popen:
            return peer.popen([sys.executable, STREAM, *argv, "--ip", peer.ip], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, stdin=subprocess.PIPE, text=True)

        def relayed_so_far() -> int:
            relay.stdin.write("?\n")
            relay.stdin.flush()
            return _line(relay, "relayed")["bytes"]

        relay = role(net.public[0], "relay")
        relay_addr = _line(relay, "ready")["addr"]
        out = {}
        for name, sink_peer, source_peer, extra in (
            ("direct", net.public[1], net.public[2], []),
            ("relayed", net.private[0], net.private[1], ["--relay", relay_addr]),
        ):
            before = relayed_so_far()
            sink = role(sink_peer, "sink", *extra)
            target = _line(sink, "ready")["addr"]
            source = role(source_peer, "source", "--target", target, "--mib", str(args.stream_mib))
            sent = _line(source, "sent")
            after = relayed_so_far()
            out[name] = {"seconds": sent["seconds"], "mb_per_s": sent["mb_per_s"], "acked": sent["acked"],
                         "relayed_bytes": after - before}
            sink.kill()
        relay.kill()
    out["relayed_over_direct_time"] = round(out["relayed"]["seconds"] / out["direct"]["seconds"], 3)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--stream-mib", type=float, default=32, help="the stream measurement's size")
    parser.add_argument("--only-streams", action="store_true", help="skip the two training runs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    reason = nat_unavailable()
    if reason:
        sys.exit(reason)
    report: dict = {"rate": args.rate, "load_avg_1m": round(os.getloadavg()[0], 2), "streams": streams(args)}
    if not args.only_streams:
        with tempfile.TemporaryDirectory() as tmp:
            public = all_public(args, Path(tmp) / "public")
            nat = two_behind_nat(args, Path(tmp) / "nat")
            punched = two_behind_nat(args, Path(tmp) / "firewalled", firewall=True)
        report.update({"steps": args.steps, "all_public": public, "two_behind_nat": nat,
                       "two_behind_firewalled_nat": punched,
                       "ratio": round(nat["steps_per_s"] / public["steps_per_s"], 3),
                       "ratio_firewalled": round(punched["steps_per_s"] / public["steps_per_s"], 3)})
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
