"""Byzantine members: digits accuracy with and without robust="clip", and what clipping costs.

    python bench/robust.py [--steps 400] [--rounds 30] [--check-fractions 0.25 0.1] [--json]
                           [--skip-accuracy] [--skip-owner] [--skip-cost]

Four real libp2p hosts on 127.0.0.1 in this process (tests/collective/hostile.py). Three parts:

1. **Accuracy.** The digits MLP (64-128-10, SGD lr 0.1, batch 32 per member, 1% top-k + error
   feedback) for ``--steps`` rounds, member 3 honest or hostile (x100, -100, -1: its values are
   multiplied just before they go on the wire), robust "none" vs "clip". Test accuracy of member 0
   (0 when its weights stopped being finite; "failed" when a round raised).
2. **A targeted owner** (issue 27), under "clip": member 3 writes 1000.0 into every value of the
   chunk it reduces, every round; a round that fails is run again without the member the honest
   ones named (what the runtime's next plan does). Test accuracy against an honest run of the same
   length, in the same run, and who was named. Then, with each of ``--check-fractions`` (sampled
   verification), the same owner negating its chunk instead (which stays inside the bound every
   member checks, so only a drawn recomputation catches it): accuracy, and the step it was named at.
3. **Healthy-path cost.** No hostile member; rounds of a flat gradient rotate between "none",
   "clip" (every chunk recomputed) and "clip" with each of ``--check-fractions`` (``clip@q``: a
   chunk recomputed when its verifier's draw says so) in the same run (so the machine's load is
   shared alike), for the sparse path at 1% and the dense path; median round time of each and its
   ratio to "none". The 1-minute load average before and after each part. The dense path with clip is the
   direct exchange instead of the ring, so its ratio includes that change of algorithm. A "clip"
   round carries its checks (drawn owners, a verifier per chunk, signed items, CONFIRM: issue 27),
   so its ratio is what a robust round costs in all; the quartiles of each rule's round times give
   the spread. Where a robust round's time goes: its value exchange (``direct_allreduce``:
   contributions, verification copies, reduced chunks, the verifier's check, and since sampled
   verification its CONFIRM and the drawn chunks' checks after it) and its CONFIRM
   (``Witness.confirm``), each from the moment the last member entered it to the moment the last
   one left it, medians over the same rounds; the bytes all members sent in a round (median); and
   for each ``clip@q``, the median of its rounds that drew no chunk and of those that drew some.
   Also, free of network noise, the owner's extra
   arithmetic alone (norms and scaling of one chunk) and the checks' CPU work at one member (its
   signatures, the signatures it verifies, the SHA-256 of what it sends and receives, and the
   verifier's recomputation of one chunk).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

import pytest
import torch
import trio

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from p2ptrain.collective import (
    RoundSpec,
    SparseAllReducer,
    clip_scales,
    contribution_norm,
    digest_of,
    reduce_chunk,
    scaled,
    signed_by,
)
from p2ptrain.collective import _collective, _direct, _sparse, _witness
from p2ptrain.wire import statement

_spec = importlib.util.spec_from_file_location(
    "p2ptrain_bench_hostile", Path(__file__).resolve().parent.parent / "tests" / "collective" / "hostile.py"
)
hostile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hostile)

WORLD, BAD = 4, 3
ATTACKS = {"honest": None, "x100": 100.0, "x-100": -100.0, "x-1": -1.0}
ROUND_TIMEOUT_S = 60.0  # one timed round of up to 16 MiB among four hosts sharing two cores


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="training rounds per accuracy run")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per rule and size (after 2 warm-ups)")
    parser.add_argument("--check-fractions", type=float, nargs="*", default=[0.25, 0.1],
                        help="sampled verification: the share of chunks recomputed, one clip@q rule each")
    parser.add_argument("--sparse-mib", type=float, default=16.0, help="gradient size of the sparse timing")
    parser.add_argument("--dense-mib", type=float, default=4.0, help="tensor size of the dense timing")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-owner", action="store_true", help="skip the targeted-owner runs")
    parser.add_argument("--skip-cost", action="store_true", help="skip the healthy-path timings")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


async def accuracy(collectives, steps: int, say) -> list[dict]:
    rows = []
    base = 0
    for attack, factor in ATTACKS.items():
        for robust in ("none", "clip"):
            base += 1_000_000
            times: list[float] = []
            started = time.perf_counter()
            try:
                acc, _ = await hostile.train_digits(
                    collectives, steps=steps, robust=robust, hostile={} if factor is None else {BAD: factor},
                    first_round=base, on_round=lambda _step, seconds: times.append(seconds),
                )
                outcome: float | str = round(acc, 4)
            except Exception as error:  # a round that raised (e.g. the hostile member's own NaN) is a result here
                while isinstance(error, BaseExceptionGroup):
                    error = error.exceptions[0]
                outcome = f"failed: {type(error).__name__}: {str(error)[:120]}"
            row = {"attack": attack, "robust": robust, "accuracy": outcome, "steps": steps, "rounds_completed": len(times),
                   "median_round_ms": round(statistics.median(times) * 1e3, 2) if times else None,
                   "seconds": round(time.perf_counter() - started, 1)}
            say(row)
            rows.append(row)
    return rows


async def owner_accuracy(collectives, steps: int, fractions: list[float], say) -> list[dict]:
    """Digits under "clip": honest, then member 3 poisoning the chunk it owns (see the docstring)."""
    rows = []
    runs = [("honest", {}, 1.0), ("owner writes 1000.0", {"poison": 1000.0}, 1.0)]
    runs += [("owner negates its chunk", {"flip": True}, q) for q in fractions]
    for n, (attack, how, fraction) in enumerate(runs):
        named: list[int] = []
        named_at: list[int] = []
        owners = {BAD: hostile.Owner(collectives[BAD], **how)} if how else {}
        started = time.perf_counter()
        with pytest.MonkeyPatch.context() as patch:
            hostile.install(patch)
            acc, _ = await hostile.train_digits(
                collectives, steps=steps, robust="clip", hostile={}, owners=owners, named=named,
                first_round=(1 << 42) * (n + 1), check_fraction=fraction,
                on_round=lambda step, _seconds: named_at.append(step) if named and not named_at else None,
            )
        row = {"owner": attack, "robust": "clip", "check_fraction": fraction, "accuracy": round(acc, 4),
               "steps": steps, "named": named, "named_at_step": named_at[0] if named_at else None,
               "seconds": round(time.perf_counter() - started, 1)}
        say(row)
        rows.append(row)
    return rows


async def round_cost(collectives, numel: int, density: float, rounds: int, first_round: int,
                     fractions: list[float]) -> dict:
    """Median round time (slowest member) with each rule, rounds rotating between them (the order
    shifts every iteration, so no rule always follows the same one)."""
    ring = [c.peer_id for c in collectives]
    grads = [gradient(numel, i) for i in range(WORLD)]
    rules = cost_rules(density, fractions, ROUND_TIMEOUT_S)
    names = list(rules)
    reducers = {rule: [SparseAllReducer(c, spec) for c in collectives] for rule, spec in rules.items()}
    times: dict[str, list[float]] = {rule: [] for rule in names}
    parts: dict[str, dict[str, list[float]]] = {rule: {"exchange": [], "confirm": []} for rule in names[1:]}
    by_draw: dict[str, dict[bool, list[float]]] = {rule: {False: [], True: []} for rule in names[1:]}
    sent: dict[str, list[int]] = {rule: [] for rule in names}  # bytes the members put on the wire, per round
    load = os.getloadavg()[0]
    with pytest.MonkeyPatch.context() as patch:
        spans = phase_clocks(patch)
        for i in range(rounds + 2):
            for rule in rotation(names, i):
                round_id = first_round + len(names) * i + names.index(rule)
                for seen in spans.values():
                    seen.clear()
                started = time.perf_counter()
                with trio.fail_after(ROUND_TIMEOUT_S):
                    async with trio.open_nursery() as nursery:
                        for r, g in zip(reducers[rule], grads):
                            nursery.start_soon(lambda r=r, g=g: r.allreduce(g, ring, round_id))
                if i >= 2:
                    times[rule].append(time.perf_counter() - started)
                    sent[rule].append(sum(c.last_round.bytes_sent for c in collectives))
                    if rule != "none":
                        for name in ("exchange", "confirm"):
                            seen = spans[name]
                            parts[rule][name].append(max(end for _, end in seen) - max(start for start, _ in seen))
                        by_draw[rule][any(n for _, n in spans["drawn"])].append(times[rule][-1])
    none = statistics.median(times["none"])
    row: dict = {"numel": numel, "density": density, "rounds": rounds, "load_1min": [round(load, 2)],
                 "none_ms": round(none * 1e3, 2), "none_spread_ms": spread(times["none"]),
                 "none_sent_bytes": int(statistics.median(sent["none"]))}
    for rule in names[1:]:
        median = statistics.median(times[rule])
        mean = statistics.mean(times[rule]) / statistics.mean(times["none"])
        row[rule] = {"ms": round(median * 1e3, 2), "ratio": round(median / none, 3), "mean_ratio": round(mean, 3),
                     "spread_ms": spread(times[rule]),
                     "exchange_ms": round(statistics.median(parts[rule]["exchange"]) * 1e3, 2),
                     "confirm_ms": round(statistics.median(parts[rule]["confirm"]) * 1e3, 2),
                     "sent_bytes": int(statistics.median(sent[rule]))}
        if rule != "clip":  # sampled: rounds that drew no chunk (they end at CONFIRM) and those that drew some
            for key, drew in (("undrawn", False), ("drawn", True)):
                seen = by_draw[rule][drew]
                row[rule][f"{key}_rounds"] = len(seen)
                row[rule][f"{key}_ratio"] = round(statistics.median(seen) / none, 3) if seen else None
    row["load_1min"].append(round(os.getloadavg()[0], 2))
    row["owner_clip_ms"] = round(owner_clip_seconds(grads, density) * 1e3, 3)
    row["checks_cpu_ms"] = round(checks_seconds(grads, density) * 1e3, 3)
    return row


def gradient(numel: int, member: int) -> torch.Tensor:
    """Member ``member``'s flat gradient of the cost timings (fixed seed: the same in every run)."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(member))


def cost_rules(density: float, fractions: list[float], timeout: float) -> dict[str, RoundSpec]:
    """The rules the cost timings compare, by name: "none" first (the baseline), "clip", then
    "clip@q" for each sampled fraction q (bench/robust_wan.py times the same ones)."""
    rules = {"none": RoundSpec(density=density, timeout=timeout),
             "clip": RoundSpec(density=density, robust="clip", timeout=timeout)}
    for q in fractions:
        rules[f"clip@{q:g}"] = RoundSpec(density=density, robust="clip", check_fraction=q, timeout=timeout)
    return rules


def rotation(names: list[str], i: int) -> list[str]:
    """The order of the rules in iteration ``i``: shifted by one every iteration, so that no rule
    always follows the same one (the load each leaves behind is shared alike)."""
    return [names[(i + k) % len(names)] for k in range(len(names))]


def spread(seconds: list[float]) -> list[float]:
    """The quartiles (25th, 75th percentile) of round times, in ms."""
    q = statistics.quantiles(seconds, n=4)
    return [round(q[0] * 1e3, 1), round(q[2] * 1e3, 1)]


def phase_clocks(patch: pytest.MonkeyPatch) -> dict[str, list[tuple[float, float]]]:
    """Wrap the value exchange and CONFIRM of a robust round so that each call's start and end are
    recorded (one entry per member and round; the caller clears them between rounds)."""
    spans: dict[str, list[tuple[float, float]]] = {"exchange": [], "confirm": [], "drawn": []}
    exchange, confirm, drawn = _direct.direct_allreduce, _witness.Witness.confirm, _direct.drawn_chunks

    def counted_draws(*args, **kwargs):
        chosen = drawn(*args, **kwargs)
        spans["drawn"].append((0.0, float(len(chosen))))  # (unused, chunks drawn), every member alike
        return chosen

    async def timed_exchange(links, data, spec, **options):
        started = time.perf_counter()
        try:
            return await exchange(links, data, spec, **options)
        finally:
            if options.get("witness") is not None:
                spans["exchange"].append((started, time.perf_counter()))

    async def timed_confirm(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return await confirm(self, *args, **kwargs)
        finally:
            spans["confirm"].append((started, time.perf_counter()))

    patch.setattr(_sparse, "direct_allreduce", timed_exchange)
    patch.setattr(_collective, "direct_allreduce", timed_exchange)
    patch.setattr(_witness.Witness, "confirm", timed_confirm)
    patch.setattr(_direct, "drawn_chunks", counted_draws)
    return spans


def owner_clip_seconds(grads: list[torch.Tensor], density: float) -> float:
    """What clipping adds at one owner, without the network: the P norms of its chunk of the
    reduced values and the scaling of those above the median (median of 20 runs)."""
    values = max(1, int(density * grads[0].numel()))
    chunk = [g[: values // WORLD] for g in grads]
    runs = []
    for _ in range(20):
        started = time.perf_counter()
        scales = clip_scales([contribution_norm([c]) for c in chunk])
        for c, factor in zip(chunk, scales):
            scaled(c, factor)
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def checks_seconds(grads: list[torch.Tensor], density: float) -> float:
    """The checks' CPU work at one member of a robust round of this size (median of 10 runs): it
    signs its P - 1 contributions and its chunk (and its index set in a sparse round), verifies the
    signatures of the P - 1 contributions it reduces and of the P - 1 chunks (and index sets) it
    receives, hashes every value it sends and receives, and recomputes the chunk it checks."""
    values = [g[: max(WORLD, int(density * g.numel()))] for g in grads]
    per_chunk = values[0].numel() // WORLD
    pair = create_new_key_pair()
    peer = ID.from_pubkey(pair.public_key)
    sparse = density < 1.0
    signs = WORLD + sparse
    verifies = (WORLD - 1) * (2 + sparse)
    runs = []
    for _ in range(10):
        started = time.perf_counter()
        digest_of([values[0]])  # what it sends: its contributions and its chunk
        for v in values[1:]:  # what it receives: the contributions to its chunk and the other chunks
            digest_of([v[:per_chunk]])
            digest_of([v[per_chunk : 2 * per_chunk]])
        said = statement(bytes(32), 2, 0, bytes(32))
        signature = b""
        for _ in range(signs):
            signature = pair.private_key.sign(said)
        for _ in range(verifies):
            signed_by(peer, said, signature)
        reduce_chunk([[v[:per_chunk]] for v in values], 0, RoundSpec(robust="clip"))
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


async def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    say = (lambda row: None) if args.json else (lambda row: print(json.dumps(row), flush=True))
    report: dict = {"peers": WORLD, "hostile_member": BAD}
    async with hostile.hosts(WORLD) as collectives:
        if not args.skip_accuracy:
            report["accuracy"] = await accuracy(collectives, args.steps, say)
        if not args.skip_owner:
            report["owner"] = await owner_accuracy(collectives, args.steps, args.check_fractions, say)
        report["cost"] = []
        for numel, density, first in () if args.skip_cost else (
            (int(args.sparse_mib * (1 << 20)) // 4, 0.01, 1 << 40),
            (int(args.dense_mib * (1 << 20)) // 4, 1.0, 1 << 41),
        ):
            row = await round_cost(collectives, numel, density, args.rounds, first, args.check_fractions)
            say(row)
            report["cost"].append(row)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = trio.run(run, args)
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
