"""What each rank says when a group forms, gathered in one all-gather.

A formation needs three small agreements before any state moves: the group's name (a
token that rank 0 draws: ``WorkerRounds.round_id``), which rank's goodput ledger the
group keeps (ledger_sync.py), and what each rank holds of the model (its replica's
holding: DDP's step; FSDP's step, shard and copies). They were six collectives (two
broadcasts of a size and then its bytes, two all-gathers), each a few milliseconds on a
busy machine, in every regroup. One row per rank now carries them all, and the chosen
ledger follows in one broadcast whose size every rank has already seen.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from elasticjob_runtime.training.agreement import gather_rows
from elasticjob_runtime.training.ledger_sync import LedgerOffer


@dataclass(frozen=True)
class Formation:
    """Every rank's row, read."""

    token: int  # rank 0's draw: the group's name
    ledgers: list[tuple[int, int]]  # each rank's ledger claim and its copy's size
    holdings: list[list[int]]  # each rank's replica holding


def formation_row(token: int, ledger: LedgerOffer, holding: Sequence[int]) -> list[int]:
    """One rank's row: its token draw, its ledger's claim and size, its holding."""
    return [token, ledger.claim, len(ledger.data), *holding]


def read_rows(rows: Sequence[Sequence[int]]) -> Formation:
    """The rows of every rank, in rank order, as what each column means."""
    return Formation(
        token=rows[0][0],
        ledgers=[(row[1], row[2]) for row in rows],
        holdings=[list(row[3:]) for row in rows],
    )


def gather_formation(
    ledger: LedgerOffer, holding: Sequence[int], device: torch.device
) -> Formation:
    """Collective over the group just formed: every rank's row, read."""
    return read_rows(gather_rows(formation_row(secrets.randbits(32), ledger, holding), device))
