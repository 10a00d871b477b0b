"""Pauses in a run: how long training stood still after a join, a death or a coordinator change.

Reads the node logs of one run (every ``node.log`` below DIR: the demo's ``--workdir``, or the
fault test's ``--basetemp`` folder) and prints, across all peers, the time training ran, the rounds
logged, and each pause between two consecutive completed rounds longer than ``--min`` seconds,
with the events inside it (failures, elections, plans), so a slow recovery shows its cause.

    .venv/bin/python -m pytest tests/runtime/test_training_run.py -k late_joiner --basetemp=/tmp/run
    .venv/bin/python bench/pauses.py /tmp/run/test_a_run_survives_a_late_joi0 [--min 1.5] [--events]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

_STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d+) ")
_DONE = " done with "
_EVENTS = re.compile(
    r"failed here|\) failed:|is coordinator of|stands for|asks for them again|steps down|plan rounds|"
    r"caught up|resynced|left \(silent"
)


def _seconds(line: str) -> float | None:
    match = _STAMP.match(line)
    if match is None:
        return None
    hours, minutes, seconds = match.groups()
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def read_lines(folder: Path) -> list[tuple[float, str]]:
    """Every time-stamped line of every node.log below ``folder``, in time order."""
    lines = []
    for log in sorted(folder.rglob("node.log")):
        for line in log.read_text(errors="replace").splitlines():
            at = _seconds(line)
            if at is not None:
                lines.append((at, line))
    lines.sort(key=lambda item: item[0])
    return lines


def pauses(lines: list[tuple[float, str]], minimum: float) -> list[tuple[float, float]]:
    """(start, length) of each stretch longer than ``minimum`` with no round completed anywhere."""
    done = [at for at, line in lines if _DONE in line]
    return [(a, b - a) for a, b in zip(done, done[1:]) if b - a > minimum]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a run's folder (node.log files below it)")
    parser.add_argument("--min", type=float, default=1.5, help="shortest pause to report, seconds (default 1.5)")
    parser.add_argument("--events", action="store_true", help="print the events inside each pause")
    args = parser.parse_args()
    lines = read_lines(args.folder)
    done = [at for at, line in lines if _DONE in line]
    if not done:
        raise SystemExit(f"no completed rounds logged below {args.folder}")
    print(f"training ran {done[-1] - done[0]:.1f} s; {len(done)} round completions logged")
    for start, length in pauses(lines, args.min):
        print(f"  pause of {length:.1f} s after {next(line for t, line in lines if t == start)[:12]}")
        if args.events:
            for at, line in lines:
                if start <= at <= start + length and _EVENTS.search(line):
                    print(f"      {line[:160]}")


if __name__ == "__main__":
    main()
