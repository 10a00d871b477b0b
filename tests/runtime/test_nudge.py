"""Nudge: how one job of a run wakes another's loop (run/_run_state.py)."""

from __future__ import annotations

import trio
import trio.testing

from p2ptrain.run._run_state import Nudge


def test_a_nudge_given_while_nobody_waits_is_kept_for_the_next_wait_and_then_consumed() -> None:
    async def main() -> None:
        nudge = Nudge()
        nudge.set()
        with trio.fail_after(1):
            assert await nudge.wait(60.0) is True  # kept: returns at once
        before = trio.current_time()
        assert await nudge.wait(5.0) is False  # consumed: this wait runs to its period
        assert trio.current_time() - before >= 5.0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_nudge_wakes_a_waiting_loop_before_its_period() -> None:
    async def main() -> None:
        nudge = Nudge()
        woke: list[float] = []

        async def loop() -> None:
            woke.append(float(await nudge.wait(60.0)))
            woke.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(loop)
            await trio.sleep(1.0)
            nudge.set()
        assert woke[0] == 1.0 and woke[1] < 2.0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
