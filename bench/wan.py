"""p2ptrain against gloo across an emulated WAN: each peer in its own network namespace behind a
link limited to ``--rate`` both ways (p2ptrain.testing._wan: veth + bridge + tc tbf; no added
latency, the kernel here has no netem). Needs root.

    python bench/wan.py --peers 4 --rate 100mbit --size-mib 64 --density 0.01 --json
    python bench/wan.py --peers 4 --rate 100mbit --size-mib 64 --density 0.01 --trace   # where a round's time goes
    python bench/wan.py --peers 4 --rate 100mbit --train --json     # + time to 90% accuracy, p2ptrain/DDP/hivemind

All-reduce part: bench/allreduce.py's peers (its logic, imported), each started inside its namespace:
p2ptrain's round (``--density`` < 1: the sparse reducer; 1: the dense ring) and gloo's dense
``all_reduce`` of the same tensor, in the same run and WAN. ``floor_s`` is the bandwidth floor of
p2ptrain's round: the bytes a peer sends divided by its link rate (a peer's upload and download
run at once, each at the rate); ``gloo_floor_s`` the same for a ring all-reduce of the dense tensor.
``p2ptrain_s`` / ``floor_ratio``: the slowest member's round, timed from its own start;
``p2ptrain_span_s`` / ``span_floor_ratio``: from the first member's start to the last one's end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package: its siblings by path

import allreduce  # bench/allreduce.py: the peers and the report
import wan_train  # bench/wan_train.py: --train

from p2ptrain.testing import IFACE, emulated_wan, parse_rate, wan_unavailable

DENSE_VALUE_BYTES = 4  # gloo reduces float32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rate", default="100mbit", help="every peer's link, both ways (tc units: 20mbit, 1gbit)")
    parser.add_argument("--slow-rate", default=None, help="peer 0's link instead (one slow peer)")
    parser.add_argument("--size-mib", type=float, default=64)
    parser.add_argument("--density", type=float, default=0.01, help="1.0: the dense ring")
    parser.add_argument("--value-dtype", choices=sorted(allreduce.VALUE_DTYPES), default="float32")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up)")
    parser.add_argument("--timeout", type=float, default=300.0, help="per-hop deadline in seconds")
    parser.add_argument("--skip-gloo", action="store_true")
    parser.add_argument("--trace", action="store_true", help="peers log each phase of a round (stderr)")
    parser.add_argument("--train", action="store_true",
                        help="also: time to 90%% test accuracy for p2ptrain, DDP and hivemind (bench/wan_train.py)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    wan_train.add_arguments(parser)
    return parser.parse_args(argv)


def machine() -> dict:
    """What the figures were measured on: a ratio in one run is comparable, a time only here."""
    return {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}


def allreduce_rounds(args: argparse.Namespace) -> dict:
    """bench/allreduce.py's gloo and p2ptrain rounds, each peer in its namespace; floors added."""
    inner = allreduce.parse_args([
        "--peers", str(args.peers), "--size-mib", str(args.size_mib), "--density", str(args.density),
        "--value-dtype", args.value_dtype, "--rounds", str(args.rounds), "--timeout", str(args.timeout),
        "--gloo-ifname", IFACE, *(["--skip-gloo"] if args.skip_gloo else []), *(["--trace"] if args.trace else []),
    ])
    rate = parse_rate(args.rate)
    rates = [args.slow_rate or args.rate] + [args.rate] * (args.peers - 1)
    load_before = machine()
    with emulated_wan(args.peers, rates=rates) as wan:
        inner.gloo_addr = wan[0].ip

        def launch(i: int, argv: list[str]) -> list[str]:
            return [*wan[i].exec_prefix(), *argv, "--listen-ip", wan[i].ip]

        report = allreduce.measure(inner, launch)
    slowest = parse_rate(args.slow_rate) if args.slow_rate else rate
    bytes_per_sec = min(rate, slowest) / 8
    dense_bytes = 2 * (args.peers - 1) / args.peers * allreduce.numel_of(inner) * DENSE_VALUE_BYTES
    report.update(
        rate=args.rate, rate_bits=rate, slow_rate=args.slow_rate,
        floor_s=report["bytes_per_peer"] / bytes_per_sec,
        max_floor_s=report["max_bytes_per_peer"] / bytes_per_sec,
        gloo_bytes_per_peer=dense_bytes, gloo_floor_s=dense_bytes / bytes_per_sec,
        machine={**machine(), "load_avg_1m_before": load_before["load_avg_1m"]},
    )
    report["floor_ratio"] = report["p2ptrain_s"] / report["floor_s"]
    report["span_floor_ratio"] = report["p2ptrain_span_s"] / report["floor_s"]
    report["gloo_floor_ratio"] = report["gloo_s"] / report["gloo_floor_s"] if report["gloo_s"] else None
    return report


def print_rounds(args: argparse.Namespace, r: dict) -> None:
    mode = "dense ring" if args.density >= 1.0 else f"top-k {args.density:g} ({r['value_dtype']} values)"
    print(f"{args.peers} peers behind {args.rate} links, {args.size_mib:g} MiB float32, {mode}, "
          f"median of {args.rounds} rounds (load {r['machine']['load_avg_1m']} on {r['machine']['cpus']} CPUs)")
    print(f"  p2ptrain round  {r['p2ptrain_s']:8.3f} s   floor {r['floor_s']:.3f} s   ({r['floor_ratio']:.2f}x floor; "
          f"first start to last end {r['p2ptrain_span_s']:.3f} s, {r['span_floor_ratio']:.2f}x)")
    print(f"  bytes per peer  {r['bytes_per_peer']:12,.0f}   (max {r['max_bytes_per_peer']:,})")
    if r["gloo_s"] is not None:
        print(f"  gloo all_reduce {r['gloo_s']:8.3f} s   floor {r['gloo_floor_s']:.3f} s   "
              f"({r['gloo_floor_ratio']:.2f}x floor; p2ptrain / gloo = {r['time_ratio']:.3f})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = wan_unavailable()
    if reason:
        print(f"bench/wan.py: {reason}", file=sys.stderr)
        return 2
    report = allreduce_rounds(args)
    if args.train:
        report.update(wan_train.train_race(args))
    if args.json:
        print(json.dumps(report))
    else:
        print_rounds(args, report)
        if args.train:
            print(f"time to {report['target_accuracy']:.0%} test accuracy, {report['model']}, batch "
                  f"{report['batch_per_peer']} per peer: " + ", ".join(
                      f"{name} {t} s" for name, t in report["time_to_target_s"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
