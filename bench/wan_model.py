"""A model of one all-reduce round's time from the protocol's message schedule, fitted to
bench/wan.py's emulated runs, predicting rounds at 16-1,024 peers with mixed link rates and latency.

    python bench/wan_model.py --fit /tmp/wan-matrix.jsonl [--json]

Schedules (what p2ptrain sends; docs/collective.md):

- sparse (sliced CLT-k over the direct exchange): every member selects k/P indices from its slice
  (CPU), broadcasts them to the P-1 others (~1.3 B each), then the direct all-reduce of the k
  values: each sends (P-1)/P of them to their owners, each owner sends its reduced part to P-1
  members. Three one-hop phases; each ends when the slowest member's upload and download of that
  phase are done; 3(P-1) messages per member per round.
- dense ring: 2(P-1) hops, each moving n/P values from every member to its right neighbour; a hop
  ends when the slowest link of the ring has moved its share.

Time of a phase = latency (one way, per hop) + max over members of bytes / own rate + messages x
per-message cost. The fitted constants are the round's fixed cost (setup, CPU) and the per-message
cost, by least squares over the measured rounds (the emulated links add no latency: latency is a
parameter of the prediction, not of the fit).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

INDEX_BYTES = 1.3  # gap-encoded index at 1% density (docs/collective.md)
FRAME_OVERHEAD_BYTES = 64  # frame header + yamux + Noise per message, ~


@dataclass
class Fit:
    fixed_s: float  # per round: setup handshake, selection and the rest of a round's CPU
    per_message_s: float  # per message a member sends or receives
    residual_s: float  # RMS error of the fit over the measured rounds


def sparse_phases(n: int, density: float, peers: int, value_bytes: int) -> list[tuple[float, int]]:
    """(bytes a member sends in the phase, messages it sends) for the three phases."""
    k = math.ceil(density * n)
    per = k / peers
    return [
        ((peers - 1) * (per * INDEX_BYTES + FRAME_OVERHEAD_BYTES), peers - 1),  # indices to everyone
        ((peers - 1) * (per * value_bytes + FRAME_OVERHEAD_BYTES), peers - 1),  # values to owners
        ((peers - 1) * (per * value_bytes + FRAME_OVERHEAD_BYTES), peers - 1),  # reduced part back
    ]


def sparse_round_s(n: int, density: float, rates_bps: Sequence[float], latency_s: float, fit: Fit,
                   value_bytes: int = 4) -> float:
    """Predicted sparse round: per phase, the slowest member's link (upload and download carry the
    same bytes), one hop of latency, the member's messages at the fitted cost."""
    peers = len(rates_bps)
    slowest = min(rates_bps) / 8
    total = fit.fixed_s
    for nbytes, messages in sparse_phases(n, density, peers, value_bytes):
        total += latency_s + nbytes / slowest + 2 * messages * fit.per_message_s
    return total


def ring_round_s(n: int, rates_bps: Sequence[float], latency_s: float, fit: Fit, value_bytes: int = 4) -> float:
    """Predicted dense ring: 2(P-1) hops of n/P values; each waits on the slowest link and a latency."""
    peers = len(rates_bps)
    slowest = min(rates_bps) / 8
    hop = latency_s + (n / peers * value_bytes + FRAME_OVERHEAD_BYTES) / slowest + 2 * fit.per_message_s
    return fit.fixed_s + 2 * (peers - 1) * hop


def fit_sparse(rows: Sequence[dict]) -> Fit:
    """Least squares of measured - link time = fixed + per_message x 2 x messages, over sparse rows."""
    xs, ys = [], []
    for r in rows:
        if r["density"] >= 1.0:
            continue
        n = int(r["size_mib"] * (1 << 20)) // 4
        value_bytes = 2 if r["value_dtype"] == "float16" else 4
        zero = Fit(0.0, 0.0, 0.0)
        link = sparse_round_s(n, r["density"], [r["rate_bits"]] * r["peers"], 0.0, zero, value_bytes)
        messages = sum(m for _, m in sparse_phases(n, r["density"], r["peers"], value_bytes))
        xs.append(2 * messages)
        ys.append(r["p2ptrain_s"] - link)
    if len(set(xs)) < 2:
        raise SystemExit("fit: need sparse runs at two peer counts")
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 0.0)
    fixed = my - slope * mx
    residual = math.sqrt(statistics.mean((y - fixed - slope * x) ** 2 for x, y in zip(xs, ys)))
    return Fit(fixed, slope, residual)


def predict(fit: Fit, n: int, density: float, peers: Sequence[int], latency_s: float) -> list[dict]:
    """Rounds at each peer count: all links 100 Mbit/s, and a mix (a quarter of the peers at 20
    Mbit/s, the rest 100 Mbit/s to 1 Gbit/s): sparse, and the dense ring, at ``latency_s``."""
    out = []
    for p in peers:
        uniform = [100e6] * p
        mixed = [20e6 if i % 4 == 0 else (100e6 if i % 4 in (1, 2) else 1e9) for i in range(p)]
        out.append({
            "peers": p,
            "sparse_100mbit_s": sparse_round_s(n, density, uniform, latency_s, fit),
            "sparse_mixed_s": sparse_round_s(n, density, mixed, latency_s, fit),
            "ring_100mbit_s": ring_round_s(n, uniform, latency_s, fit),
            "ring_mixed_s": ring_round_s(n, mixed, latency_s, fit),
            "messages_per_member": 3 * (p - 1),
            "values_per_message": math.ceil(density * n) / p,
        })
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", required=True, help="bench/wan.py --json output, one object a line")
    parser.add_argument("--size-mib", type=float, default=64)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--latency-ms", type=float, default=25.0, help="one-way latency per hop of a real WAN")
    parser.add_argument("--per-message-ms", type=float, default=None,
                        help="use this per-message cost instead of the fitted one (a sensitivity check)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with open(args.fit) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    fit = fit_sparse(rows)
    if args.per_message_ms is not None:
        fit.per_message_s = args.per_message_ms / 1e3
    n = int(args.size_mib * (1 << 20)) // 4
    table = predict(fit, n, args.density, [4, 8, 16, 64, 256, 1024], args.latency_ms / 1e3)
    if args.json:
        print(json.dumps({"fit": fit.__dict__, "latency_ms": args.latency_ms, "predictions": table}))
        return 0
    sparse = sum(r["density"] < 1 for r in rows)
    print(f"fit over {len(rows)} runs ({sparse} sparse): fixed {fit.fixed_s * 1e3:.0f} ms a round, "
          f"{fit.per_message_s * 1e3:.2f} ms a "
          f"message, RMS error {fit.residual_s * 1e3:.0f} ms; latency {args.latency_ms:g} ms a hop")
    print(f"{'peers':>6} {'sparse 100M':>12} {'sparse mix':>11} {'ring 100M':>10} {'ring mix':>9} {'msgs':>6} {'vals/msg':>9}")
    for r in table:
        print(f"{r['peers']:>6} {r['sparse_100mbit_s']:>11.2f}s {r['sparse_mixed_s']:>10.2f}s {r['ring_100mbit_s']:>9.1f}s "
              f"{r['ring_mixed_s']:>8.1f}s {r['messages_per_member']:>6} {r['values_per_message']:>9.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
