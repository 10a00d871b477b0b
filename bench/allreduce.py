"""All-reduce round time: p2ptrain's ring over libp2p vs torch.distributed gloo, same run, same machine.

    python bench/allreduce.py --peers 4 --size-mib 64 --density 0.01 [--json]

Starts ``--peers`` peer processes on 127.0.0.1 that all-reduce a float32 tensor of ``--size-mib`` MiB
(density 1.0: the exact dense ring; below 1: SparseAllReducer, i.e. per-round top-k selection by the
rotating leader + error feedback + CLT-k ring), then the same number of gloo processes doing a dense
``all_reduce`` of the same tensor. A round's time (``p2ptrain_s``) is the slowest peer's, each
peer timing from its own start (every round follows a one-element barrier round, so members start
within a few ms of each other); ``p2ptrain_span_s`` is the stricter reading, from the first
member's start to the last member's end (one machine's wall clock). The median over ``--rounds``
is printed, with the bytes each peer put on the wire (mean over peers; the leader sends a little
more, and the leader rotates) and the lower bound 2k(P-1)/P x value size.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch

from processes import Launch, join, result, run_workers, same_machine  # bench/processes.py: the parent-worker protocol

VALUE_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--size-mib", type=float, default=64)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--value-dtype", choices=sorted(VALUE_DTYPES), default="float32")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up)")
    parser.add_argument("--timeout", type=float, default=60.0, help="per-hop deadline in seconds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (both sides)")
    parser.add_argument("--skip-gloo", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--profile", metavar="DIR", help="write each peer's cProfile stats to DIR")
    parser.add_argument("--trace", action="store_true", help="peers log each phase of a round")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--gloo-port", type=int, default=None, help=argparse.SUPPRESS)
    # Where the workers listen and gloo rendezvous: loopback here; bench/wan.py's namespaces set them.
    parser.add_argument("--listen-ip", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--gloo-addr", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--gloo-ifname", default="lo", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def numel_of(args: argparse.Namespace) -> int:
    return int(args.size_mib * (1 << 20)) // 4


def worker_argv(args: argparse.Namespace, extra: list[str]) -> list[str]:
    return [
        sys.executable, os.path.abspath(__file__), "--peers", str(args.peers), "--size-mib", str(args.size_mib),
        "--density", str(args.density), "--value-dtype", args.value_dtype, "--rounds", str(args.rounds),
        "--timeout", str(args.timeout), "--threads", str(args.threads), "--gloo-addr", args.gloo_addr,
        "--gloo-ifname", args.gloo_ifname, *(["--profile", args.profile] if args.profile else []),
        *(["--trace"] if args.trace else []), *extra,
    ]


# ---- p2ptrain peer process ---------------------------------------------------------------------


async def p2p_worker(args: argparse.Namespace) -> None:
    from libp2p.crypto.ed25519 import create_new_key_pair
    from multiaddr import Multiaddr

    from p2ptrain.collective import Collective, RoundSpec, SparseAllReducer
    from p2ptrain.net import make_host
    from p2ptrain.base import large_empty

    me = args.worker
    if args.trace:
        import logging

        logging.basicConfig(format=f"peer{me} %(created).4f %(name)s %(message)s")  # wall clock: comparable across peers
        logging.getLogger("p2ptrain.collective").setLevel(logging.DEBUG)
    listen = Multiaddr(f"/ip4/{args.listen_ip}/tcp/0")
    host = make_host(create_new_key_pair(), [listen])
    async with host.run(listen_addrs=[listen]):
        collective = Collective(host)  # before anyone can dial us: the handler must be registered
        ring = await join(host, me)
        n = numel_of(args)
        grad = torch.randn(n, generator=torch.Generator().manual_seed(me))
        spec = RoundSpec(density=args.density, value_dtype=VALUE_DTYPES[args.value_dtype], timeout=args.timeout)
        reducer = SparseAllReducer(collective, spec)
        barrier = torch.zeros(1)
        # Reused, as the trainer's (training/_sync.py) is: a fresh 64 MiB tensor costs page faults;
        # on huge pages where the kernel offers them, as the trainer's is too.
        out = large_empty(n).zero_()
        times, sent, cpu, spans = [], [], [], []
        for r in range(args.rounds + 1):
            # A one-element round first: everyone starts the timed round together.
            await collective.allreduce(barrier, ring, 2 * r + 1, RoundSpec(timeout=120, start_timeout=120))
            if args.density >= 1.0:
                data = grad.clone()
                wall_started, started, cpu_started = time.time(), time.perf_counter(), time.process_time()
                await collective.dense_round(data, ring, 2 * r + 2, RoundSpec(timeout=args.timeout))
            else:
                wall_started, started, cpu_started = time.time(), time.perf_counter(), time.process_time()
                await reducer.allreduce(grad, ring, 2 * r + 2, out=out)
            elapsed = time.perf_counter() - started
            if r:  # the first round warms up
                times.append(elapsed)
                spans.append((wall_started, wall_started + elapsed))  # wall clock: one machine's, comparable
                cpu.append(time.process_time() - cpu_started)
                sent.append(collective.last_round.bytes_sent)
        result({"times": times, "bytes": sent, "cpu": cpu, "spans": spans})


def run_p2p(args: argparse.Namespace, launch: Launch = same_machine) -> list[dict]:
    """Every peer's worker (bench/wan.py's ``launch`` starts each inside its namespace); their results."""
    return run_workers(args.peers, lambda i: worker_argv(args, ["--worker", str(i)]), launch, timeout=900)


# ---- gloo process ------------------------------------------------------------------------------


def gloo_worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR=args.gloo_addr, MASTER_PORT=str(args.gloo_port), GLOO_SOCKET_IFNAME=args.gloo_ifname)
    rank = args.worker
    dist.init_process_group("gloo", rank=rank, world_size=args.peers)
    grad = torch.randn(numel_of(args), generator=torch.Generator().manual_seed(rank))
    times = []
    for r in range(args.rounds + 1):
        data = grad.clone()
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(data)
        elapsed = torch.tensor([time.perf_counter() - started])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if r:
            times.append(float(elapsed))
    if rank == 0:
        result({"times": times})
    dist.destroy_process_group()


def run_gloo(args: argparse.Namespace, launch: Launch = same_machine) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            launch(i, worker_argv(args, ["--worker", str(i), "--gloo-port", str(port)])), stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(args.peers)
    ]
    try:
        outs = [proc.communicate(timeout=900)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if any(proc.returncode for proc in procs):
        raise SystemExit("a gloo process failed")
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT "))
    return json.loads(line[7:])["times"]


# ---- driver ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # P processes share a small machine
    if args.worker is not None:
        if args.gloo_port is not None:
            gloo_worker(args)
        else:
            import trio

            if args.profile:
                import cProfile

                cProfile.runctx(
                    "trio.run(p2p_worker, args)", globals(), {"trio": trio, "args": args},
                    os.path.join(args.profile, f"peer{args.worker}.pstats"),
                )
            else:
                trio.run(p2p_worker, args)
        return 0
    report = measure(args)
    if args.json:
        print(json.dumps(report))
        return 0
    print_report(args, report)
    return 0


def measure(args: argparse.Namespace, launch: Launch = same_machine) -> dict:
    """gloo's rounds, then p2ptrain's, each peer's worker started by ``launch``; the report."""
    from p2ptrain.collective import bucket_ks

    n = numel_of(args)
    k = sum(bucket_ks([n], args.density)) if args.density < 1.0 else n
    value_size = 4 if args.density >= 1.0 else torch.empty((), dtype=VALUE_DTYPES[args.value_dtype]).element_size()
    lower_bound = 2 * k * (args.peers - 1) / args.peers * value_size

    gloo_times = [] if args.skip_gloo else run_gloo(args, launch)
    results = run_p2p(args, launch)
    per_round = [max(r["times"][i] for r in results) for i in range(args.rounds)]
    # The stricter reading: from the first member's start to the last member's end (start skew
    # after the barrier round counted in full).
    spans = [max(r["spans"][i][1] for r in results) - min(r["spans"][i][0] for r in results) for i in range(args.rounds)]
    bytes_rounds = [statistics.mean(r["bytes"][i] for r in results) for i in range(args.rounds)]
    max_bytes = max(max(r["bytes"]) for r in results)
    report = {
        "peers": args.peers,
        "size_mib": args.size_mib,
        "density": args.density,
        "value_dtype": args.value_dtype if args.density < 1.0 else "float32",
        "rounds": args.rounds,
        "p2ptrain_s": statistics.median(per_round),
        "p2ptrain_span_s": statistics.median(spans),
        "gloo_s": statistics.median(gloo_times) if gloo_times else None,
        "bytes_per_peer": statistics.median(bytes_rounds),
        # CPU time (all threads) a peer spends on a round: what a round takes from local compute.
        "cpu_s_per_peer": statistics.median(statistics.mean(r["cpu"][i] for r in results) for i in range(args.rounds)),
        "max_bytes_per_peer": max_bytes,
        "lower_bound_bytes": lower_bound,
        "p2ptrain_rounds_s": per_round,
        "gloo_rounds_s": gloo_times,
    }
    report["time_ratio"] = report["p2ptrain_s"] / report["gloo_s"] if gloo_times else None
    report["bytes_ratio"] = report["bytes_per_peer"] / lower_bound
    return report


def print_report(args: argparse.Namespace, report: dict) -> None:
    lower_bound, gloo_times = report["lower_bound_bytes"], report["gloo_rounds_s"]
    max_bytes = report["max_bytes_per_peer"]
    mode = "dense ring" if args.density >= 1.0 else f"top-k {args.density:g} ({report['value_dtype']} values)"
    print(f"{args.peers} peers, {args.size_mib:g} MiB float32, {mode}, median of {args.rounds} rounds")
    print(f"  p2ptrain round   {report['p2ptrain_s'] * 1e3:9.1f} ms   (first start to last end "
          f"{report['p2ptrain_span_s'] * 1e3:.1f} ms)")
    print(f"  CPU per peer     {report['cpu_s_per_peer'] * 1e3:9.1f} ms   (all threads of one peer process)")
    if gloo_times:
        print(f"  gloo all_reduce  {report['gloo_s'] * 1e3:9.1f} ms   (p2ptrain / gloo = {report['time_ratio']:.2f})")
    print(f"  bytes per peer   {report['bytes_per_peer']:12,.0f}   (max {max_bytes:,})")
    print(f"  lower bound      {lower_bound:12,.0f}   (bytes / bound = {report['bytes_ratio']:.3f})")


if __name__ == "__main__":
    sys.exit(main())
