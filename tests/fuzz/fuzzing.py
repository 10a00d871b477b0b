"""A small fuzzer shared by the CI fuzz tests (tests/fuzz/test_fuzz.py) and bench/fuzz.py.

A *target* is one decoder of network or disk input wrapped as ``decode(data: bytes)``, with the
error types it declares and a few valid samples. The fuzzer feeds it hostile bytes: random
bytes, bit flips and splices of the samples, and the classic JSON attacks (deep nesting, huge
integers, 1e400, NaN, long strings) written into the samples' JSON. A *crash* is any exception
outside the declared ones (RecursionError, OverflowError, TypeError, KeyError, ...).

Targets live in ``tests/fuzz/targets_*.py``, each exporting ``TARGETS: list[FuzzTarget]``; both the
tests and the bench find them with :func:`load_targets`, so a new decoder is fuzzed in CI and in
the bench by adding it in one place. This file is loaded by path under the module name
``_p2ptrain_fuzzing`` (tests/ is no package), so a targets file says
``from _p2ptrain_fuzzing import FuzzTarget``.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODULE_NAME = "_p2ptrain_fuzzing"


class LazySeeds(Sequence[bytes]):
    """Seeds made on first use rather than when the targets file is imported: every pytest worker
    imports every targets file to collect the tests, and the seeds of an hf model (its task read,
    its model file: transformers' model machinery, ~3 CPU-s) cost more than the rest of the
    collection of tests/fuzz."""

    def __init__(self, make: Callable[[], Sequence[bytes]]) -> None:
        self._make = make
        self._seeds: tuple[bytes, ...] | None = None

    def _made(self) -> tuple[bytes, ...]:
        if self._seeds is None:
            self._seeds = tuple(self._make())
        return self._seeds

    def __getitem__(self, index: Any) -> Any:
        return self._made()[index]

    def __len__(self) -> int:
        return len(self._made())


@dataclass(frozen=True)
class FuzzTarget:
    """One decoder under fuzz: ``decode`` takes bytes and may raise only ``declared`` errors."""

    name: str
    decode: Callable[[bytes], Any]
    declared: tuple[type[BaseException], ...]
    seeds: Sequence[bytes] = field(default_factory=tuple)
    max_size: int = 1 << 16


@dataclass
class Outcome:
    """What a run of cases found for one target."""

    name: str
    cases: int = 0
    rejected: int = 0
    accepted: int = 0
    crashes: list[tuple[bytes, str]] = field(default_factory=list)
    seconds: float = 0.0
    slowest_s: float = 0.0
    slowest_input: bytes = b""


def load_targets() -> list[FuzzTarget]:
    """Every ``TARGETS`` list of ``tests/fuzz/targets_*.py``, in file order."""
    assert sys.modules.get(MODULE_NAME) is sys.modules[__name__], f"load this file as {MODULE_NAME}"
    found: list[FuzzTarget] = []
    for path in sorted(HERE.glob("targets_*.py")):
        name = f"_p2ptrain_fuzz_{path.stem}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        found.extend(module.TARGETS)
    return found


# ---- hostile inputs ---------------------------------------------------------------------------

_HOSTILE_VALUES: tuple[Any, ...] = (
    10**400,
    -(10**400),
    2**63,
    -(2**63) - 1,
    2**64,
    1e308,
    -1e308,
    0,
    -1,
    "",
    "x" * 70_000,
    None,
    True,
    [],
    {},
    [[]] * 3,
    {"": None},
)
_HOSTILE_TEXT = (
    b"1e400",
    b"-1e400",
    b"NaN",
    b"Infinity",
    b"1" * 5000,
    b"[" * 100_000,
    b"{\"a\":" * 50_000,
    b"\"\\ud800\"",
    b"\xff\xfe",
)


def _paths(value: Any, path: tuple[Any, ...] = (), out: list[tuple[Any, ...]] | None = None) -> list[tuple[Any, ...]]:
    """Paths to the nodes of a JSON value (the first 256), so each node is equally likely to be hit."""
    out = [] if out is None else out
    if len(out) >= 256:
        return out
    out.append(path)
    if isinstance(value, dict):
        for key in sorted(value):
            _paths(value[key], (*path, key), out)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _paths(item, (*path, i), out)
    return out


def _replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    copy: Any = dict(value) if isinstance(value, dict) else list(value)
    copy[head] = _replaced(value[head], rest, new)
    return copy


def _walk_replace(value: Any, rng: random.Random) -> Any:
    """A copy of a JSON value with one node, chosen uniformly, replaced by something hostile."""
    path = rng.choice(_paths(value))
    node: Any = value
    for step in path:
        node = node[step]
    pick = rng.randrange(6)
    if pick <= 2:  # numbers are where the overflows hide: half the draws
        new = rng.choice(_HOSTILE_VALUES[:7])
    elif pick == 3:
        new = rng.choice(_HOSTILE_VALUES[7:])
    elif pick == 4:  # deep nesting in place of this node
        new = node
        for _ in range(rng.choice((40, 200, 2000))):
            new = [new]
    else:
        new = {"unexpected": node} if rng.random() < 0.5 else [node, node]
    return _replaced(value, path, new)


def _json_mutation(seed: bytes, rng: random.Random) -> bytes | None:
    try:
        value = json.loads(seed)
    except (ValueError, RecursionError):
        return None
    try:
        text = json.dumps(_walk_replace(value, rng), sort_keys=True, separators=(",", ":"))
    except (ValueError, RecursionError):
        return None
    return text.encode()


def _byte_mutation(seed: bytes, rng: random.Random) -> bytes:
    data = bytearray(seed)
    for _ in range(rng.randint(1, 8)):
        op = rng.randrange(5)
        if op == 0 and data:  # flip a bit
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        elif op == 1 and data:  # set a byte to an edge value
            data[rng.randrange(len(data))] = rng.choice((0, 1, 0x7F, 0x80, 0xFF))
        elif op == 2:  # insert hostile text
            i = rng.randint(0, len(data))
            data[i:i] = rng.choice(_HOSTILE_TEXT)[: rng.choice((8, 64, 100_000))]
        elif op == 3 and data:  # cut
            i = rng.randrange(len(data))
            del data[i : i + rng.randint(1, 64)]
        else:  # duplicate a slice
            if data:
                i = rng.randrange(len(data))
                j = min(len(data), i + rng.randint(1, 256))
                data[i:i] = data[i:j] * rng.randint(1, 4)
    return bytes(data)


def hostile_input(target: FuzzTarget, rng: random.Random) -> bytes:
    """One case for ``target``: mostly mutations of its valid samples, some raw noise."""
    roll = rng.random()
    if target.seeds and roll < 0.6:
        mutated = _json_mutation(rng.choice(target.seeds), rng)
        if mutated is not None:
            return mutated[: target.max_size * 2]
    if target.seeds and roll < 0.9:
        return _byte_mutation(rng.choice(target.seeds), rng)[: target.max_size * 2]
    if roll < 0.95:
        return rng.choice(_HOSTILE_TEXT)
    return rng.randbytes(rng.choice((0, 1, 7, 64, 1024)))


def run_case(target: FuzzTarget, data: bytes) -> tuple[str, str]:
    """Feed one input: ('accepted' | 'rejected' | 'crash', detail)."""
    try:
        target.decode(data)
    except target.declared as exc:
        return "rejected", type(exc).__name__
    except BaseException as exc:  # anything undeclared is the finding
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return "crash", f"{type(exc).__name__}: {str(exc)[:200]}"
    return "accepted", ""


def cases(target: FuzzTarget, seed: int, count: int) -> Iterator[bytes]:
    rng = random.Random(seed)
    for sample in target.seeds:  # the valid samples themselves must pass through too
        yield sample
    for _ in range(max(0, count - len(target.seeds))):
        yield hostile_input(target, rng)


def fuzz(target: FuzzTarget, count: int, seed: int = 0) -> Outcome:
    """Run ``count`` cases against ``target``; timing per case is recorded, never asserted."""
    out = Outcome(target.name)
    started = time.perf_counter()
    for data in cases(target, seed, count):
        t0 = time.perf_counter()
        verdict, detail = run_case(target, data)
        took = time.perf_counter() - t0
        if took > out.slowest_s:
            out.slowest_s, out.slowest_input = took, data[:256]
        out.cases += 1
        if verdict == "crash":
            out.crashes.append((data[:512], detail))
        elif verdict == "rejected":
            out.rejected += 1
        else:
            out.accepted += 1
    out.seconds = time.perf_counter() - started
    return out
