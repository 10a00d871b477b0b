"""Who reduces each chunk of the direct exchange, and who checks it.

A plain round keeps the ring's owners: chunk c is reduced by member c-1 (ring order, which follows
sorted peer IDs), the same member every round. That made the owner of a given slice of the model
(the output layer, at the end of the flat vector) a matter of choosing a key: issue 27's attacker
needed 5-16 tries to own it in every round. A robust round instead draws the owners from a value
every member holds and none chose (:func:`drawn`, from the runtime's hash of the run's last
confirmed model and the round's number, ``training.plans.owner_seed``), and gives each chunk a
*verifier*: another member that receives every contribution to that chunk too, recomputes it and
compares (:mod:`p2ptrain.collective._direct`). The verifier of chunk c is the owner of chunk c + 1,
so every member owns one chunk and checks one other, and nobody checks its own.

Who owns a chunk does not change its bits: a chunk is always summed in the same order, starting at
ring position c (as the ring adds), whoever does the adding. So the draw changes who is trusted,
never the result.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Owners:
    """``owner[c]``: the ring position that reduces chunk c; ``verifier[c]``: the one that recomputes
    it (None: nobody checks, a plain round)."""

    owner: tuple[int, ...]
    verifier: tuple[int, ...] | None = None

    def owned_by(self, member: int) -> int:
        """The chunk ``member`` reduces."""
        return self.owner.index(member)

    def checked_by(self, member: int) -> int | None:
        """The chunk ``member`` verifies (None in a plain round)."""
        return None if self.verifier is None else self.verifier.index(member)

    def describe(self) -> str:
        """For the round's digest: members that drew different owners fail the round at HELLO."""
        return "owners=" + ",".join(map(str, self.owner))


def ring_owners(size: int) -> Owners:
    """The ring's owners (chunk c by member c-1), unchecked: what a plain round uses."""
    return Owners(tuple((c - 1) % size for c in range(size)))


def drawn(size: int, seed: int) -> Owners:
    """Owners in an order drawn from ``seed`` (a Fisher-Yates shuffle driven by SHA-256, the same on
    every machine), each chunk checked by the owner of the next chunk in that order."""
    order = list(range(size))
    for i in range(size - 1, 0, -1):
        word = hashlib.sha256(b"p2ptrain/owners/v1\0" + seed.to_bytes(8, "big") + i.to_bytes(4, "big")).digest()
        j = int.from_bytes(word[:8], "big") % (i + 1)  # bias < 2**-50 for any ring we run
        order[i], order[j] = order[j], order[i]
    owner = tuple(order)
    return Owners(owner, tuple(owner[(c + 1) % size] for c in range(size)) if size > 1 else None)
