"""Fuzz every decoder of network or disk input with 10,000+ hostile cases each.

    python bench/fuzz.py [--cases 10000] [--seed 0] [--only NAME] [--json]

The targets are tests/fuzz/targets_*.py (the same ones CI fuzzes with a few hundred cases). For
each it reports cases/s, how many inputs were rejected (a declared error) or accepted, crashes
(any other exception: the first few with their input), and the slowest case. Exit status 1 when
any target crashed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _fuzzing():
    """tests/fuzz/fuzzing.py, loaded by path under the name its targets import it by."""
    name = "_p2ptrain_fuzzing"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "fuzz" / "fuzzing.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=10_000, help="cases per decoder (default 10000)")
    parser.add_argument("--seed", type=int, default=0, help="random seed: the same seed gives the same cases")
    parser.add_argument("--only", action="append", default=[], help="fuzz only targets whose name contains this")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()

    fuzzing = _fuzzing()
    targets = [t for t in fuzzing.load_targets() if not args.only or any(o in t.name for o in args.only)]
    results = []
    for target in targets:
        out = fuzzing.fuzz(target, args.cases, seed=args.seed)
        results.append(
            {
                "name": out.name,
                "cases": out.cases,
                "cases_per_s": round(out.cases / out.seconds, 1) if out.seconds else None,
                "rejected": out.rejected,
                "accepted": out.accepted,
                "crashes": len(out.crashes),
                "first_crashes": [{"error": d, "input": repr(i[:120])} for i, d in out.crashes[:3]],
                "slowest_ms": round(out.slowest_s * 1000, 2),
                "slowest_input": repr(out.slowest_input[:80]),
            }
        )
        if not args.json:
            r = results[-1]
            print(
                f"{r['name']:<32} {r['cases']:>7} cases {r['cases_per_s']:>10} /s  rejected {r['rejected']:>6}"
                f"  accepted {r['accepted']:>6}  crashes {r['crashes']:>4}  slowest {r['slowest_ms']:>8} ms",
                flush=True,
            )
            for crash in r["first_crashes"]:
                print(f"    crash: {crash['error']} on {crash['input']}")
    crashed = sum(r["crashes"] for r in results)
    if args.json:
        print(json.dumps({"cases_per_target": args.cases, "seed": args.seed, "targets": results, "crashes": crashed}))
    else:
        print(f"{len(results)} decoders, {crashed} crashes")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
