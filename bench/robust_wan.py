"""The healthy-path cost of robust rounds with members as separate processes: on loopback, or each
in its own network namespace behind an emulated link (issue 27).

    python bench/robust_wan.py --rate loopback [--rounds 16] [--check-fractions 0.25 0.1] [--json]
    python bench/robust_wan.py --rate 100mbit --rounds 16 --json       # needs root (namespaces, tc)
    python bench/robust_wan.py --rate 20mbit --rounds 12 --json
    python bench/robust_wan.py --rate loopback --direct-baseline --profile /tmp/prof   # where the time goes
    python bench/robust_wan.py --rate loopback --take-away confirm      # what a part of the checks costs

bench/robust.py's third part (its rules, their rotation and its phase clocks, imported) with the
four members in four processes instead of one: each runs its own trio loop on its own core share,
so a member's signatures, checks and Noise/yamux work no longer wait for the other three's on one
Python thread. ``--rate loopback``: the processes talk over 127.0.0.1 (what the one-thread effect
alone costs); a tc rate (``100mbit``, ``20mbit``): each member sits in a namespace of
p2ptrain.testing._wan behind a link of that rate both ways (what the link adds). The harness has
tbf but no netem: no latency is added, the round trip between namespaces is that of a veth pair
(well under a millisecond); see the report's ``rtt_note``.

Rounds of a flat gradient (sparse 1% of ``--sparse-mib``, dense ``--dense-mib``) rotate between
"none", "clip" and "clip@q" per ``--check-fractions`` in the same run, every timed round after a
one-element barrier round (bench/allreduce.py's way), so members start within a few ms of each
other. A round's time is the slowest member's, each timing from its own start; ``span_ms`` is
from the first member's start to the last one's end. Per rule: the median and quartiles of round
times, the ratio of medians to "none", the bytes all members sent (median), the CPU time one
member's process spent on the round (``cpu_ms``: the mean over members, median over rounds; what
the round would take from a dedicated machine's core), for clip rules the
median of the members' slowest value exchange and CONFIRM (each member's own call: in separate
processes there is no common "last one entered"), and for clip@q the ratios of the rounds that drew
no chunk and of those that drew some.

``--direct-baseline`` adds the rule "direct" to the dense rounds: the plain direct exchange (no
clip, no signatures, no verifier), i.e. the robust rounds' transport, where "none" is the ring;
its ratio is the part of a dense robust round's cost that the exchange's shape takes before any
check. ``--profile DIR`` writes each member's cProfile of each shape and rule's timed rounds
(``SHAPE-RULE-mN.prof``, timed by the CPU time of the event loop's thread: what a worker thread
hashes is not in it; profiling slows the Python-heavy paths, so time ratios come from a run
without it).

``--take-away PART`` measures what a part of the checks costs by turning it off in every member's
robust rounds (insecure, for this measurement only; plain rounds are untouched), cumulatively in
this order: ``confirm`` (no CONFIRM exchange, so nothing is drawn either), ``ed25519`` (also: zero
signatures, every signature accepted), ``sha256`` (also: no SHA-256 of what is sent and received).
What is left at ``sha256`` is the robust rounds' transport, trailers, clip and the bound checks.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package: its siblings by path

import robust  # bench/robust.py: the rules, their rotation, the phase clocks
from processes import Launch, join, result, run_workers, same_machine  # bench/processes.py: the parent-worker protocol

WORLD = robust.WORLD
HOP_TIMEOUT_S = 120.0  # a dense 4 MiB robust round at 20 Mbit/s moves ~9 MB per member
BARRIER_TIMEOUT_S = 120.0
PROCESS_TIMEOUT_S = 3600.0
SHAPE_BASE = 1 << 40  # round ids of shape s start at s * SHAPE_BASE: never reused within a run
TAKE_AWAY = ("confirm", "ed25519", "sha256")  # --take-away: each part includes the ones before it


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="loopback",
                        help="'loopback' (separate processes on 127.0.0.1) or every member's link rate (tc units)")
    parser.add_argument("--rounds", type=int, default=16, help="timed rounds per rule and shape (after 2 warm-ups)")
    parser.add_argument("--check-fractions", type=float, nargs="*", default=[0.25, 0.1])
    parser.add_argument("--sparse-mib", type=float, default=16.0, help="gradient size of the sparse rounds (1%%)")
    parser.add_argument("--dense-mib", type=float, default=4.0, help="tensor size of the dense rounds")
    parser.add_argument("--skip-dense", action="store_true")
    parser.add_argument("--skip-sparse", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--direct-baseline", action="store_true",
                        help="also time dense rounds of the plain direct exchange (rule 'direct': the robust "
                             "rounds' transport without their checks, where 'none' is the ring)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="write each member's cProfile of each shape and rule's timed rounds to DIR "
                             "(SHAPE-RULE-mN.prof; CPU time of the event loop's thread)")
    parser.add_argument("--take-away", choices=TAKE_AWAY, default=None,
                        help="turn off part of the robust rounds' checks, cumulatively in the order "
                             + ", ".join(TAKE_AWAY) + " (insecure: to measure what each costs)")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--listen-ip", default="127.0.0.1", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def shapes(args: argparse.Namespace) -> list[tuple[str, int, float]]:
    """(name, numel, density) of each timed shape, bench/robust.py's two."""
    out = []
    if not args.skip_sparse:
        out.append(("sparse", int(args.sparse_mib * (1 << 20)) // 4, 0.01))
    if not args.skip_dense:
        out.append(("dense", int(args.dense_mib * (1 << 20)) // 4, 1.0))
    return out


# ---- a member's process -------------------------------------------------------------------------


async def member(args: argparse.Namespace) -> None:
    """One member: listen, print its address, read everyone's, connect, time every shape's rounds."""
    import pytest
    from libp2p.crypto.ed25519 import create_new_key_pair
    from multiaddr import Multiaddr

    from p2ptrain.collective import Collective, RoundSpec, SparseAllReducer
    from p2ptrain.collective import _collective, _direct
    from p2ptrain.net import make_host

    import torch

    listen = Multiaddr(f"/ip4/{args.listen_ip}/tcp/0")
    host = make_host(create_new_key_pair(), [listen])
    async with host.run(listen_addrs=[listen]):
        collective = Collective(host)  # before anyone can dial: the handler must be registered
        ring = await join(host, args.worker, timeout=BARRIER_TIMEOUT_S)
        barrier = torch.zeros(1)
        report = {}
        for s, (shape, numel, density) in enumerate(shapes(args)):
            rules = robust.cost_rules(density, args.check_fractions, HOP_TIMEOUT_S)
            if args.direct_baseline and density == 1.0:
                rules["direct"] = rules["none"]  # a plain dense round, its ring swapped below
            names = list(rules)
            reducers = {rule: SparseAllReducer(collective, spec) for rule, spec in rules.items()}
            grad = robust.gradient(numel, args.worker)
            rows: dict[str, list[dict]] = {rule: [] for rule in names}
            profilers: dict[str, cProfile.Profile] = {}
            n = s * SHAPE_BASE
            with pytest.MonkeyPatch.context() as patch:
                if args.take_away:
                    take_away(patch, TAKE_AWAY[: TAKE_AWAY.index(args.take_away) + 1])
                spans = robust.phase_clocks(patch)
                direct = {"on": False}
                ring_allreduce = _collective.ring_allreduce

                async def ring_or_direct(links, data, *, average, segment_bytes):  # type: ignore[no-untyped-def]
                    if not direct["on"]:
                        return await ring_allreduce(links, data, average=average, segment_bytes=segment_bytes)
                    spec = RoundSpec(op="mean" if average else "sum", timeout=HOP_TIMEOUT_S)
                    return await _direct.direct_allreduce(links, data, spec, segment_bytes=segment_bytes)

                open_round = collective.hub.open_round

                def open_round_meshed(*options, mesh=False, **more):  # type: ignore[no-untyped-def]
                    return open_round(*options, mesh=mesh or direct["on"], **more)  # the exchange's P - 1 channels

                patch.setattr(_collective, "ring_allreduce", ring_or_direct)
                patch.setattr(collective.hub, "open_round", open_round_meshed)
                for i in range(args.rounds + 2):
                    for rule in robust.rotation(names, i):
                        n += 1
                        await collective.allreduce(barrier, ring, 2 * n + 1,
                                                   RoundSpec(timeout=BARRIER_TIMEOUT_S, start_timeout=BARRIER_TIMEOUT_S))
                        for seen in spans.values():
                            seen.clear()
                        direct["on"] = rule == "direct"
                        profiler = None
                        if args.profile and i >= 2:
                            profiler = profilers.setdefault(rule, cProfile.Profile(time.thread_time))
                        wall, started, cpu = time.time(), time.perf_counter(), time.process_time()
                        if profiler is not None:
                            profiler.enable()
                        await reducers[rule].allreduce(grad, ring, 2 * n + 2)
                        if profiler is not None:
                            profiler.disable()
                        elapsed = time.perf_counter() - started
                        cpu = time.process_time() - cpu
                        if i >= 2:
                            rows[rule].append({
                                "s": elapsed, "wall": [wall, wall + elapsed], "sent": collective.last_round.bytes_sent,
                                "cpu": cpu,
                                "exchange": sum(end - start for start, end in spans["exchange"]),
                                "confirm": sum(end - start for start, end in spans["confirm"]),
                                "drawn": sum(int(k) for _, k in spans["drawn"]),
                            })
            report[shape] = rows
            for rule, profiler in profilers.items():
                profiler.dump_stats(os.path.join(args.profile, f"{shape}-{rule}-m{args.worker}.prof"))
        result(report)


def take_away(patch: Any, parts: tuple[str, ...]) -> None:
    """Turn ``parts`` of a robust round's checks off in this process (--take-away): insecure."""
    from p2ptrain.collective import _direct, _sampling, _witness

    if "confirm" in parts:
        async def no_confirm(self, extra=b"", heard=None):  # type: ignore[no-untyped-def]
            return {self.links.me: extra}

        patch.setattr(_witness.Witness, "confirm", no_confirm)
        patch.setattr(_direct, "drawn_chunks", lambda *args, **kwargs: set())
    if "ed25519" in parts:
        patch.setattr(_witness.Witness, "signature", lambda self, said, key, digest: bytes(64))
        patch.setattr(_witness.Witness, "signed", lambda self, *args: True)
    if "sha256" in parts:
        for module in (_witness, _direct, _sampling):
            patch.setattr(module, "digest_of", lambda pieces: bytes(32))


# ---- the driver ---------------------------------------------------------------------------------


def run_members(args: argparse.Namespace, launch: Launch) -> list[dict]:
    """Start the four members (each by ``launch``), give them each other's addresses, collect."""
    passed = ["--rounds", str(args.rounds), "--sparse-mib", str(args.sparse_mib), "--dense-mib", str(args.dense_mib),
              "--check-fractions", *map(str, args.check_fractions),
              *(["--profile", os.path.abspath(args.profile)] if args.profile else []),
              *(["--direct-baseline"] if args.direct_baseline else []),
              *(["--take-away", args.take_away] if args.take_away else []),
              *(["--skip-dense"] if args.skip_dense else []), *(["--skip-sparse"] if args.skip_sparse else [])]
    return run_workers(WORLD, lambda i: [sys.executable, os.path.abspath(__file__), *passed, "--worker", str(i)],
                       launch, timeout=PROCESS_TIMEOUT_S)


def summarize(per_member: list[dict[str, list[dict]]]) -> dict:
    """One shape's rows of all members: per rule, the rounds' slowest member, medians, ratios."""
    names = list(per_member[0])
    rounds = len(per_member[0]["none"])
    slowest = {rule: [max(m[rule][r]["s"] for m in per_member) for r in range(rounds)] for rule in names}
    none = statistics.median(slowest["none"])
    out: dict = {}
    for rule in names:
        rows = [[m[rule][r] for m in per_member] for r in range(rounds)]
        median = statistics.median(slowest[rule])
        entry = {
            "ms": round(median * 1e3, 2), "ratio": round(median / none, 3),
            "spread_ms": robust.spread(slowest[rule]),
            "span_ms": round(statistics.median(max(x["wall"][1] for x in row) - min(x["wall"][0] for x in row)
                                               for row in rows) * 1e3, 2),
            "sent_bytes": int(statistics.median(sum(x["sent"] for x in row) for row in rows)),
            "cpu_ms": round(statistics.median(statistics.mean(x["cpu"] for x in row) for row in rows) * 1e3, 2),
        }
        if rule not in ("none", "direct"):
            entry["exchange_ms"] = round(statistics.median(max(x["exchange"] for x in row) for row in rows) * 1e3, 2)
            entry["confirm_ms"] = round(statistics.median(max(x["confirm"] for x in row) for row in rows) * 1e3, 2)
        if rule.startswith("clip@"):
            for key, drew in (("undrawn", False), ("drawn", True)):
                seen = [t for t, row in zip(slowest[rule], rows) if (row[0]["drawn"] > 0) == drew]
                entry[f"{key}_rounds"] = len(seen)
                entry[f"{key}_ratio"] = round(statistics.median(seen) / none, 3) if seen else None
        out[rule] = entry
    return out


def measure(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()[0]
    if args.rate == "loopback":
        results = run_members(args, same_machine)
    else:
        from p2ptrain.testing import emulated_wan, wan_unavailable

        reason = wan_unavailable()
        if reason:
            raise SystemExit(f"bench/robust_wan.py: {reason}")
        with emulated_wan(WORLD, rate=args.rate) as wan:
            results = run_members(args, lambda i, argv: [*wan[i].exec_prefix(), *argv, "--listen-ip", wan[i].ip])
    report: dict = {
        "members": WORLD, "rate": args.rate, "rounds": args.rounds, "cpus": os.cpu_count(),
        "take_away": args.take_away,
        "load_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "rtt_note": "no latency added (tc netem absent): veth/loopback round trip, well under 1 ms",
    }
    for shape, numel, density in shapes(args):
        report[shape] = {"numel": numel, "density": density, **summarize([r[shape] for r in results])}
    return report


def print_report(report: dict) -> None:
    print(f"{report['members']} member processes, {report['rate']}, {report['rounds']} rounds per rule, "
          f"load {report['load_1min'][0]} -> {report['load_1min'][1]} on {report['cpus']} CPUs")
    if report["take_away"]:
        print(f"  robust rounds without: {', '.join(TAKE_AWAY[: TAKE_AWAY.index(report['take_away']) + 1])} (insecure)")
    for shape in ("sparse", "dense"):
        if shape not in report:
            continue
        row = report[shape]
        print(f"  {shape} ({row['numel']:,} values, density {row['density']:g})")
        for rule, e in row.items():
            if not isinstance(e, dict):
                continue
            extra = ""
            if "undrawn_ratio" in e:
                extra = (f"  undrawn x{e['undrawn_ratio']} ({e['undrawn_rounds']}),"
                         f" drawn x{e['drawn_ratio']} ({e['drawn_rounds']})")
            print(f"    {rule:10s} {e['ms']:9.1f} ms  x{e['ratio']:<6} q1-q3 {e['spread_ms']}  "
                  f"{e['sent_bytes']:>11,} B  cpu {e['cpu_ms']:.1f} ms{extra}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)  # four processes share a small machine
    if args.worker is not None:
        import trio

        trio.run(member, args)
        return 0
    report = measure(args)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
