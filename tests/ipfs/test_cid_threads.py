"""Valid CIDs parse when threads parse their first ones together.

multiformats registers most base codecs on first use, unlocked; two threads that first decode a
base32 CID together made the loser raise, and a node refused a valid task ("'bafkrei...' is not a valid
CID") because two tasks arrived 13 ms apart. The race needs a fresh interpreter (a process registers
each codec once), so each try is one; a 1 µs switch interval makes it likely: before the fix most
processes saw a refusal.
"""

from __future__ import annotations

import subprocess
import sys

from p2ptrain.ipfs import cid_str, make_cid

PROCESSES = 5

_RACE = """
import sys, threading
sys.setswitchinterval(1e-6)
from p2ptrain.ipfs import parse_cid
texts = TEXTS
barrier = threading.Barrier(len(texts))
refused = []
def parse(text):
    barrier.wait()
    try:
        parse_cid(text)
    except Exception as exc:
        refused.append(repr(exc))
threads = [threading.Thread(target=parse, args=(text,)) for text in texts]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(timeout=30)
print(len(refused), refused[:1])
"""


def test_threads_parsing_their_first_cids_together_all_succeed() -> None:
    # Texts made here, not in the child: making one there would build base32 before the threads start.
    texts = [cid_str(make_cid(bytes([i]) * 7, "raw")) for i in range(16)]
    texts.append("f01551220" + "ab" * 32)  # base16: another codec built on first use
    script = _RACE.replace("TEXTS", repr(texts))
    for _ in range(PROCESSES):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("0 "), done.stdout
