"""What the pure protocol tests build their books on: task texts (small models, and a dataset CID
that nothing fetches: a book never reads its data), a lone member's election, and members' elections
talking over links of chosen delays."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from p2ptrain.protocol import Election, ElectionMessage, View

CID = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
MLP = 'name = "mlp"\nkwargs = { in_features = 4, hidden = [8], out_features = 2 }'


def lm(depth: int) -> str:
    """A transformer_lm small enough to cut and plan in a blink: ``depth`` blocks, ``depth + 2`` pieces."""
    return f'name = "transformer_lm"\nkwargs = {{ vocab_size = 61, context = 16, width = 16, depth = {depth}, heads = 2 }}'


def task_text(model: str = MLP, *, total_steps: int = 100, checkpoint_interval: int | None = None,
              min_peers: int = 2, pipeline: str = "") -> str:
    """A task's TOML: ``model`` (its [model] table's lines), SGD, batches of 8, and ``pipeline``
    (the [pipeline] table's lines; none: a data-parallel task)."""
    interval = f"checkpoint_interval = {checkpoint_interval}\n" if checkpoint_interval is not None else ""
    text = (f'\nname = "t"\n[model]\n{model}\n[dataset]\nmanifest = "{CID}"\n[optimizer]\nname = "sgd"\nlr = 0.1\n'
            f"[training]\nbatch_size = 8\ntotal_steps = {total_steps}\n{interval}[peers]\nmin = {min_peers}\n")
    return text + (f"[pipeline]\n{pipeline}" if pipeline else "")


def elected(election: Election, now: float = 0.0) -> float:
    """``election``'s lone member (re-)elected coordinator of a new term, from ``now``: the time then."""
    if election.is_coordinator:
        election.step_down(now)
    term, until = election.term, now + 100.0
    while not election.is_coordinator or election.term == term:
        now += 0.25
        assert now < until, "no coordinator"
        election.tick(now, View(advertising=frozenset()))
    return now


class Ticking(Protocol):
    """A member of :func:`over_links`: its election's tick at ``now`` and what it sends then."""

    def tick(self, now: float) -> list[ElectionMessage]: ...


def over_links(members: Mapping[str, Ticking], seconds: float, delay: Callable[[str, str], float],
               receive: Callable[[str, float, str, ElectionMessage], list[ElectionMessage]],
               done: Callable[[], bool] = lambda: False, dt: float = 0.25) -> float | None:
    """Drive ``members`` (by peer) for ``seconds``: each ticks every ``dt`` (run/_leading.py: a
    quarter of the heartbeat), and what one sends reaches every other ``delay(sender, receiver)``
    later, in the order sent, where ``receive(receiver, now, sender, message)`` hands it over and
    returns what the receiver sends back. The time ``done()`` first held after a tick (None: never)."""
    in_flight: list[tuple[float, int, str, str, ElectionMessage]] = []  # (arrival, order, to, from, message)
    now, order = 0.0, 0

    def send(src: str, outs: list[ElectionMessage]) -> None:
        nonlocal order
        for msg in outs:
            for dst in members:
                if dst != src:
                    order += 1
                    in_flight.append((now + delay(src, dst), order, dst, src, msg))

    while now < seconds:
        now += dt
        for me, member in members.items():
            send(me, member.tick(now))
        in_flight.sort()
        while in_flight and in_flight[0][0] <= now:
            _, _, dst, src, msg = in_flight.pop(0)
            send(dst, receive(dst, now, src, msg))
            in_flight.sort()
        if done():
            return now
    return None
