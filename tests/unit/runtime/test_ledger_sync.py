"""Which goodput ledger a group takes when it forms (training/ledger_sync.py): the rule,
and the collective itself over a real gloo group."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from spawned_ranks import on_ranks

from elasticjob_runtime.goodput import ledger as gl
from elasticjob_runtime.goodput.keeper import LedgerKeeper
from elasticjob_runtime.training.formation import gather_formation
from elasticjob_runtime.training.ledger_sync import (
    Held,
    claim,
    earliest,
    offer,
    source,
    sync_ledger,
)


def book(through: float) -> gl.Ledger:
    return gl.committed(gl.committed(gl.opened(0.0), 1, through - 1), 2, through)


def test_the_old_rank_0s_copy_wins_even_over_a_newer_survivors() -> None:
    claims = [claim(book(9.0), Held.NEW), claim(book(10.3), Held.SURVIVOR)]
    claims.append(claim(book(10.1), Held.PUBLISHER))
    assert source(claims) == 2


def test_a_newcomer_takes_the_newest_survivors_copy_even_if_its_own_looks_newer() -> None:
    # rank 0 is new (its agent opened the round): its copy must not win over a
    # survivor's, which saw the fault
    claims = [claim(gl.opened(99.0), Held.NEW), claim(book(10.1), Held.SURVIVOR)]
    claims.append(claim(book(10.3), Held.SURVIVOR))
    assert source(claims) == 2


def test_a_group_of_new_processes_has_no_source_and_knows_its_earliest_start() -> None:
    claims = [claim(gl.opened(7.0), Held.NEW), claim(gl.opened(5.25), Held.NEW)]
    assert source(claims) is None
    assert earliest(claims) == 5.25


def _sync(rank: int, port: int, out: Any, held: list[Held], published: dict[str, Any]) -> None:
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, 3, is_master=rank == 0, timeout=timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
    mine = LedgerKeeper(book(10.0 + rank) if held[rank] is not Held.NEW else gl.opened(3.0 + rank))
    reads: list[int] = []

    def read() -> gl.Ledger | None:
        reads.append(rank)
        return gl.decode(published) if published else None

    own = offer(mine, held[rank])
    formed = gather_formation(own, [], torch.device("cpu"))  # the Run's one gather
    sync_ledger(mine, own, formed.ledgers, rank, torch.device("cpu"), read)
    out.put((rank, gl.encode(mine.ledger), reads))
    dist.destroy_process_group()


def test_every_rank_ends_with_the_survivors_copy_and_nobody_reads_etcd() -> None:
    held = [Held.NEW, Held.SURVIVOR, Held.NEW]
    got = sorted(on_ranks(_sync, 3, held, {}))
    assert {str(doc) for _, doc, _ in got} == {str(gl.encode(book(11.0)))}
    assert [reads for _, _, reads in got] == [[], [], []]


def test_a_new_group_takes_what_rank_0_read_back_or_opens_at_the_earliest_start() -> None:
    held = [Held.NEW] * 3
    published = gl.encode(book(50.0))
    got = sorted(on_ranks(_sync, 3, held, published))
    restart = gl.encode(gl.restarted(gl.decode(published), "restart"))
    assert [doc for _, doc, _ in got] == [restart] * 3
    assert [reads for _, _, reads in got] == [[0], [], []]  # rank 0 alone reads
    got = sorted(on_ranks(_sync, 3, held, {}))
    assert [doc for _, doc, _ in got] == [gl.encode(gl.opened(3.0))] * 3
