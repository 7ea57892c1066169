"""When a group forms, every rank takes one copy of the goodput ledger, so that whichever
rank is 0 now publishes one that saw the fault, and the figures it publishes go on from
the previous rank 0's (goodput/keeper.py).

Which copy (:func:`source`, pure): the old rank 0's if it lived through the regroup;
else the survivor's with the newest entry; else, every rank being new (the run starts or
its group restarted), rank 0's, which it makes from the ledger the run published or,
for a new run, from the earliest start among the ranks. Each rank's claim and the size
of its copy travel in the formation's one all-gather (formation.py), so the copy itself
is one broadcast of a few hundred bytes; etcd is read only by rank 0 of a group of new
processes.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from elasticjob_runtime import contract
from elasticjob_runtime.checkpoints.state_transfer import broadcast_bytes, broadcast_sized
from elasticjob_runtime.goodput import ledger as gl
from elasticjob_runtime.goodput.keeper import LedgerKeeper, group_start
from elasticjob_runtime.goodput.ledger import Ledger


class Held(enum.IntEnum):
    """What a rank's copy is worth to the group, least first (a claim's low two bits)."""

    NEW = 0  # a process that has just started: its copy is opened at its own start
    SURVIVOR = 1  # kept through the regroup
    PUBLISHER = 2  # kept through it, and this rank was rank 0: the copy published so far


def claim(ledger: Ledger, held: Held) -> int:
    """A rank's offer: milliseconds (the copy's last entry, or for a new process its
    opening) and what it holds, in one integer."""
    moment = ledger.through if held is not Held.NEW else ledger.opened
    return max(0, round(moment * 1000)) * 4 + int(held)


def source(claims: Sequence[int]) -> int | None:
    """The rank whose copy the group takes; None when every rank is new (then rank 0
    makes the group's: :func:`group_start`)."""
    best = max(range(len(claims)), key=lambda rank: (claims[rank] % 4, claims[rank] // 4))
    return None if claims[best] % 4 == Held.NEW else best


def earliest(claims: Sequence[int]) -> float:
    """The earliest opening among new processes' claims (unix seconds)."""
    return min(c // 4 for c in claims if c % 4 == Held.NEW) / 1000


@dataclass(frozen=True)
class LedgerOffer:
    """A rank's copy as the group forms: its claim, and its bytes, sent if the group
    takes this copy."""

    claim: int
    data: bytes


def offer(keeper: LedgerKeeper, held: Held) -> LedgerOffer:
    return LedgerOffer(claim(keeper.ledger, held), _wire(keeper))


def _wire(keeper: LedgerKeeper) -> bytes:
    """The keeper's copy as it travels to the other ranks."""
    return json.dumps(keeper.encoded()).encode()


def sync_ledger(
    keeper: LedgerKeeper,
    mine: LedgerOffer,
    offers: Sequence[tuple[int, int]],
    rank: int,
    device: torch.device,
    read: Callable[[], Ledger | None],
) -> None:
    """Collective over the group just formed: every rank ends with the chosen copy.
    ``offers``: every rank's claim and the size of its copy, in rank order (gathered with
    the formation's row). ``read``: the run's published ledger (called on rank 0 of a
    group of new processes)."""
    claims = [c for c, _ in offers]
    src = source(claims)
    if src is None:  # rank 0 makes the group's copy now: its size is not known yet
        src = 0
        if rank == 0:
            told = os.environ.get(contract.ROUND_CAUSE)  # a hang's restart says so
            keeper.adopt(group_start(read(), earliest(claims), told))
        data = _wire(keeper) if rank == 0 else b""
        received = broadcast_bytes(data, 0, device)
    else:
        received = broadcast_sized(mine.data if rank == src else b"", offers[src][1], src, device)
    if rank != src:
        keeper.adopt(gl.decode(json.loads(received)))
