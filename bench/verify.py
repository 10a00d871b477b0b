"""What checking a lineage costs: `model verify`'s audit and `Chain.from_bytes` under a task's rules.

    PYTHONPATH=$PWD .venv/bin/python bench/verify.py [--records 100] [--members 4 8 32] [--repeat 5] [--json]

For each member count it builds a chain of ``--records`` records made as a run of that many members
would make them (every record signed by its coordinator, carrying the votes of every member, kept
with a quorum of attestations: ``p2ptrain.testing.proven_chain``), then times, best of ``--repeat``:

- ``audit_s``: ``lineage.audit`` over the chain's bytes (what ``model verify`` runs: every line
  parsed, every signature checked, every break named);
- ``load_s``: ``Chain.from_bytes`` with the task's rules (what a member loading a head and
  ``model fetch --latest`` run);
- ``baseline_s``: parsing the same lines and checking only each record's own signature, which is
  what a chain load cost before records carried their proofs (issue 27), in the same run.

Also the chain's bytes per record. Signatures are Ed25519 through py-libp2p's key classes.
"""

from __future__ import annotations

import argparse
import json
import time

from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.testing import proven_chain
from p2ptrain.protocol import Chain, ChainRules, audit, chain_lines, entry_from_bytes

TASK = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
INITIAL = "QmbFMke1KXqnYyBBWxB74N4c5SBnJMVAiMNRcGu6x1AwQH"


def best_of(repeat: int, fn) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def measure(records: int, members: int, repeat: int) -> dict[str, float]:
    keys = [create_new_key_pair() for _ in range(members)]
    rules = ChainRules(TASK, 1, 128)
    models = [f"bafkreig{str(i).rjust(51, 'a')}" for i in range(records)]
    data = proven_chain(TASK, INITIAL, models, keys, rules=rules).to_bytes()
    lines = chain_lines(data)

    def baseline() -> None:
        for line in lines:
            entry_from_bytes(line)  # one signature: the record's

    def audited() -> None:
        _, problems = audit(rules, INITIAL, data)
        assert not problems, problems[:3]

    return {
        "records": records, "members": members, "bytes_per_record": round(len(data) / records),
        "audit_s": round(best_of(repeat, audited), 4),
        "load_s": round(best_of(repeat, lambda: Chain.from_bytes(TASK, INITIAL, data, rules)), 4),
        "baseline_s": round(best_of(repeat, baseline), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=100)
    parser.add_argument("--members", type=int, nargs="+", default=[4, 8, 32])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [measure(args.records, m, args.repeat) for m in args.members]
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'members':>8} {'B/record':>9} {'audit s':>8} {'load s':>8} {'baseline s':>11}")
    for r in rows:
        print(f"{r['members']:>8} {r['bytes_per_record']:>9} {r['audit_s']:>8} {r['load_s']:>8} {r['baseline_s']:>11}")


if __name__ == "__main__":
    main()
