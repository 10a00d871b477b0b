"""run_script's failure names every member, not only the first that failed: a member that never came
up leaves the others failing with "bootstrap peer not reached", and its own log says why."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from p2ptrain.testing import run_script, script_members

# Member 1 says why it stops and exits 3 at once; member 0 waits (bounded) until it has, then
# fails with a message that only points at member 1.
SCRIPT = '''
import argparse, sys, time
from pathlib import Path
p = argparse.ArgumentParser()
for flag in ("--home", "--listen", "--member", "--members"):
    p.add_argument(flag)
p.add_argument("--bootstrap", nargs="*")
args = p.parse_args()
if args.member == "1":
    print("member 1: the port was taken", file=sys.stderr, flush=True)
    (Path(args.home).parent / "one-said").touch()
    sys.exit(3)
deadline = time.monotonic() + 60
while not (Path(args.home).parent / "one-said").exists() and time.monotonic() < deadline:
    time.sleep(0.02)
print("member 0: bootstrap peer not reached", file=sys.stderr, flush=True)
sys.exit(1)
'''


def test_a_failure_shows_every_members_log(tmp_path: Path) -> None:
    script = tmp_path / "two.py"
    script.write_text(SCRIPT)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as failed:
        run_script(script, script_members(2, tmp_path / "run"), timeout=90)
    text = str(failed.value)
    assert text.startswith("member 0 exited with 1:") and "bootstrap peer not reached" in text
    assert "--- member 1: " in text and "the port was taken" in text, text
    assert time.monotonic() - started < 90
