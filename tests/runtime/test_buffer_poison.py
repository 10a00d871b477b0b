"""One hostile member against the buffers every member combines at a checkpoint (issue 27's trust
rules; docs/security.md). BatchNorm's running statistics (every floating buffer of a user's module,
or of a torchvision model) are combined over the span's ring (run/_buffers.py) before each member
stores, hashes and attests its checkpoint: every honest member then holds the same bytes and
attests them. Before, the combination was a plain mean whatever ``[compression] robust`` said: a
member that contributed 1e30 moved every honest member's buffers by 1e30 / P (2.5e29 here), and the
honest quorum confirmed the poisoned model. Under ``robust = "clip"`` it is now the coordinate-wise
median of a witnessed gather.

Real libp2p hosts on 127.0.0.1; the honest members run the runtime's own ``Spans._average_buffers``
(a stand-in ``run`` gives it the collective, the task's robust mode, a round book and a trainer
holding a buffer vector); the hostile one joins the same round with the same call and its own values.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import trio

from p2ptrain.collective import Collective, CollectiveError
from p2ptrain.protocol import buffers_round_id, Participation
from p2ptrain.run._buffers import combine_buffers, coordinate_median
from p2ptrain.run._spans import HOP_TIMEOUT_S, Spans, START_TIMEOUT_S
from p2ptrain.testing import connected_hosts
from p2ptrain.wire import RoundPlan

DEADLINE_S = 60
SIZE = 64  # floats of buffers: a few BatchNorm layers' running means and variances


class _Buffers:
    """What ``_average_buffers`` uses of a trainer (its step, for the log line), over one flat vector."""

    step = 3

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values

    def buffer_vector(self) -> torch.Tensor:
        return self.values.clone()

    def load_buffer_vector(self, flat: torch.Tensor) -> None:
        self.values = flat.clone()


class _Book:
    """What ``_average_buffers`` tells the round book: the members a failed combination named."""

    def __init__(self) -> None:
        self.culprits: list[str | None] = []

    def note_round_failed(self, now: float, culprit: str | None = None, gone: bool = False) -> None:
        self.culprits.append(culprit)


async def _combine(robust: str, hostile_values: torch.Tensor) -> tuple[list[bool], list[torch.Tensor], list[_Book], str]:
    """Three honest members (statistics 1.0, 1.1, 1.2) and one sending ``hostile_values``, in one
    buffers round: what each honest ``_average_buffers`` returned, their buffers after, their books."""
    async with connected_hosts(4) as hosts:
        members = [str(h.id) for h in hosts]
        plan = RoundPlan(task_cid="bafy-test", term=1, round=3, attempt=0, step=3, rounds=1, base_cid="bafy-test",
                         version=1, members=tuple(members))
        honest = [_Buffers(torch.full((SIZE,), 1.0 + i / 10)) for i in range(3)]
        books = [_Book() for _ in range(3)]
        results: list[bool] = [False] * 3

        async def honest_member(i: int) -> None:
            run = SimpleNamespace(require=lambda: (honest[i], books[i]), collective=Collective(hosts[i].host),
                                  log_prefix=f"member {i}", node=SimpleNamespace(peer_id=hosts[i].id), me=hosts[i].id.to_base58(),
                                  task=SimpleNamespace(compression=SimpleNamespace(robust=robust)),
                                  participation=Participation())
            spans = object.__new__(Spans)
            spans.run = run
            results[i] = await spans._average_buffers(plan)

        async def hostile_member() -> None:
            collective, ring, round_id = Collective(hosts[3].host), [h.id for h in hosts], buffers_round_id(plan)
            try:
                if robust == "none":
                    await combine_buffers(collective, hostile_values, ring, round_id, robust=robust,
                                          timeout=HOP_TIMEOUT_S, start_timeout=START_TIMEOUT_S)
                else:  # the gather itself: combine_buffers would not send non-finite values
                    payload = hostile_values.numpy().tobytes()
                    await collective.gather(payload, ring, round_id, max_bytes=len(payload), check=lambda m, raw: None,
                                            timeout=HOP_TIMEOUT_S, start_timeout=START_TIMEOUT_S)
            except CollectiveError:  # its round fails where the honest refuse its values
                pass

        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(honest_member, i)
                nursery.start_soon(hostile_member)
        return results, [b.values for b in honest], books, members[3]


async def test_under_clip_one_member_cannot_move_the_buffers_beyond_the_honest_members_values() -> None:
    results, got, _, _ = await _combine("clip", torch.full((SIZE,), 1e30))
    assert all(results)
    assert all(torch.equal(g, got[0]) for g in got)  # one checkpoint's bytes everywhere: attested
    # The honest members' own statistics lie in [1.0, 1.2]: the median of 4 is that of the middle two.
    assert torch.allclose(got[0], torch.full((SIZE,), 1.15)), got[0][:4]


async def test_under_clip_a_member_sending_non_finite_buffers_is_named_and_no_checkpoint_is_taken() -> None:
    results, got, books, hostile = await _combine("clip", torch.full((SIZE,), math.nan))
    assert results == [False, False, False]
    assert all(book.culprits == [hostile] for book in books)  # left out of the next plans
    assert torch.equal(torch.stack([g[0] for g in got]), torch.tensor([1.0, 1.1, 1.2]))  # nobody's changed


async def test_among_trusted_members_the_buffers_are_their_mean_as_before() -> None:
    """``robust = "none"``: the exact mean (the members trust each other, as for their gradients)."""
    results, got, _, _ = await _combine("none", torch.full((SIZE,), 1.3))
    assert all(results) and all(torch.equal(g, got[0]) for g in got)
    assert torch.allclose(got[0], torch.full((SIZE,), 1.15))


def test_the_coordinate_median_stays_within_any_majority_and_ignores_the_order() -> None:
    honest = [torch.tensor([1.0, -2.0, 5.0]), torch.tensor([1.5, -1.0, 4.0]), torch.tensor([2.0, -3.0, 6.0])]
    for hostile in (torch.tensor([1e30, -1e30, 1e30]), torch.tensor([-1e30, 1e30, -1e30])):
        for parts in ([*honest, hostile], [hostile, *honest], [*honest, hostile, *honest[:1]]):
            median = coordinate_median(parts)
            lows, highs = torch.stack(honest).min(dim=0).values, torch.stack(honest).max(dim=0).values
            assert bool(((median >= lows) & (median <= highs)).all()), median
    assert torch.equal(coordinate_median(honest), torch.tensor([1.5, -2.0, 5.0]))
    assert torch.equal(coordinate_median(honest), coordinate_median(honest[::-1]))


async def test_under_clip_a_member_sending_buffers_of_another_length_is_named_and_no_checkpoint_is_taken() -> None:
    """One value more, one less, or a single one: refused by every honest member, naming the sender
    (its gather's max_bytes differs too; the round must still name it, not an honest member)."""
    for count in (SIZE + 1, SIZE - 1, 1):
        results, got, books, hostile = await _combine("clip", torch.full((count,), 1.1))
        assert results == [False, False, False], count
        assert all(book.culprits == [hostile] for book in books), count
        assert torch.equal(torch.stack([g[0] for g in got]), torch.tensor([1.0, 1.1, 1.2]))
