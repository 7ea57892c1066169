"""The formation's one all-gather (training/formation.py): what each column of a rank's
row means, and the gather and the ledger's sized broadcast over a real gloo group."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from spawned_ranks import on_ranks

from elasticjob_runtime.checkpoints.state_transfer import broadcast_sized
from elasticjob_runtime.training.formation import formation_row, gather_formation, read_rows
from elasticjob_runtime.training.ledger_sync import LedgerOffer


def test_a_row_reads_back_as_the_token_of_rank_0_the_ledger_offers_and_the_holdings() -> None:
    rows = [
        formation_row(0xDEAD, LedgerOffer(41, b"abc"), [7, 0, 2]),
        formation_row(0xBEEF, LedgerOffer(42, b"hello"), [-1, -1, 0]),
    ]
    formed = read_rows(rows)
    assert formed.token == 0xDEAD  # rank 0's draw names the group
    assert formed.ledgers == [(41, 3), (42, 5)]
    assert formed.holdings == [[7, 0, 2], [-1, -1, 0]]


def _formed(rank: int, port: int, out: Any, holding_width: int) -> None:
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, 3, is_master=rank == 0, timeout=timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
    ledger = LedgerOffer(100 + rank, f"ledger of rank {rank}".encode() * (rank + 1))
    formed = gather_formation(
        ledger, [rank * 10 + i for i in range(holding_width)], torch.device("cpu")
    )
    size = formed.ledgers[2][1]
    copy = broadcast_sized(ledger.data if rank == 2 else b"", size, 2, torch.device("cpu"))
    # nothing to send: no message, and every rank gets nothing
    empty = broadcast_sized(b"", 0, 1, torch.device("cpu"))
    mismatch = ""
    if rank == 0:
        with pytest.raises(ValueError) as raised:
            broadcast_sized(b"four", 5, 0, torch.device("cpu"))
        mismatch = str(raised.value)
    out.put((rank, formed, copy, empty, mismatch))
    dist.destroy_process_group()


def test_every_rank_reads_the_same_rows_and_takes_the_chosen_ledger_in_one_broadcast() -> None:
    got = sorted(on_ranks(_formed, 3, 2), key=lambda item: item[0])
    formations = [formed for _, formed, _, _, _ in got]
    assert all(formed == formations[0] for formed in formations)
    assert formations[0].holdings == [[0, 1], [10, 11], [20, 21]]
    assert formations[0].ledgers == [
        (100 + r, len(b"ledger of rank 0") * (r + 1)) for r in range(3)
    ]
    assert 0 <= formations[0].token < 2**32
    assert [copy for _, _, copy, _, _ in got] == [b"ledger of rank 2" * 3] * 3
    assert [empty for _, _, _, empty, _ in got] == [b""] * 3
    assert got[0][4] == "rank 0 has 4 bytes to send, its peers expect 5"
