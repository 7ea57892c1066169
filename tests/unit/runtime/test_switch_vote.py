"""The agreed switch step (training/switch_vote.py): the rule, the vote carried by a real
DDP's gradient all-reduce over gloo, and sent alone when no gradient was reduced."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from spawned_ranks import on_ranks
from torch import nn

from bench.ports import free_port
from elasticjob_runtime.training.current_ddp import CurrentDDP
from elasticjob_runtime.training.switch_vote import SwitchVote, ballot, switch_due

CPU = torch.device("cpu")


def test_a_rank_votes_to_switch_when_it_knows_a_newer_round_or_is_leaving() -> None:
    assert ballot(knows_newer_round=False, handed_over=False) == 0
    assert ballot(knows_newer_round=True, handed_over=False) == 1
    assert ballot(knows_newer_round=False, handed_over=True) == 1


def test_a_rank_follows_the_vote_even_before_its_own_agent_has_the_round() -> None:
    assert switch_due(agreed=True, world_size=3, knows_newer_round=False)
    # knowing alone is not enough where others may be mid-step: that was the straddle
    assert not switch_due(agreed=False, world_size=3, knows_newer_round=True)
    assert switch_due(agreed=False, world_size=1, knows_newer_round=True)
    assert not switch_due(agreed=False, world_size=1, knows_newer_round=False)


def test_a_ballot_rides_on_the_gradients_only_while_one_is_cast() -> None:
    vote, grads = SwitchVote(), torch.arange(3.0)
    assert vote.carry(grads) is grads
    vote.cast(1, 0)
    assert vote.carry(grads).tolist() == [0.0, 1.0, 2.0, 1.0]
    vote.discard()
    assert vote.carry(grads) is grads


@pytest.fixture
def world_of_one() -> Iterator[None]:
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_counted_vote_holds_for_its_own_round_only(world_of_one: None) -> None:
    vote = SwitchVote()
    vote.count(CPU)  # nothing cast: nothing to count
    assert not vote.agreed(4)
    vote.cast(0, 4)
    vote.count(CPU)  # no gradient carried it: an all-reduce of its own
    assert not vote.agreed(4)
    vote.cast(1, 4)
    assert not vote.agreed(4)  # cast, not yet counted
    vote.count(CPU)
    vote.count(CPU)  # the optimizer's pre-hook, then the step's end
    assert vote.agreed(4)
    assert not vote.agreed(5)  # after the regroup it says nothing of the new round


def test_a_discarded_vote_is_never_counted(world_of_one: None) -> None:
    vote = SwitchVote()
    vote.cast(1, 2)
    vote.discard()
    vote.count(CPU)
    assert not vote.agreed(2)


class SparseAndWide(nn.Module):
    """A sparse embedding (a sparse bucket) and a layer over CARRY_BYTES (a bucket of
    its own under ``bucket_cap_mb=1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.narrow = nn.Linear(4, 600)
        self.wide = nn.Linear(600, 600)
        self.emb = nn.Embedding(20, 4, sparse=True)  # last: DDP's first bucket at first

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wide(self.narrow(self.emb(idx))).sum()


def _rank(rank: int, port: int, out: Any, ballots_by_rank: dict[int, list[int]]) -> None:
    ballots = ballots_by_rank[rank]
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    vote = SwitchVote()
    ddp = CurrentDDP(model, {}, vote)
    ddp.rewrap()
    seen = []
    for step, mine in enumerate(ballots):
        vote.cast(mine, 7)
        model.zero_grad()
        if step % 2 == 0:  # the ballot rides on the gradient all-reduce
            ddp(torch.full((1, 3), float(rank + 1))).sum().backward()
            grad = model.weight.grad
            assert grad is not None
            got = grad.tolist()
        else:  # a step in which DDP reduced nothing: the vote goes alone
            got = []
        vote.count(CPU)
        seen.append((vote.agreed(7), got))
    # A sparse bucket and one too large to copy carry no ballot: it rides on a small
    # dense bucket, the same one on every rank, and the gradients are DDP's average.
    torch.manual_seed(0)
    mixed = SparseAndWide()
    mixed_ddp = CurrentDDP(mixed, {"bucket_cap_mb": 1}, vote)
    mixed_ddp.rewrap()
    for mine in ballots:
        vote.cast(mine, 8)
        mixed.zero_grad()
        mixed_ddp(torch.tensor([rank, 5])).backward()
        vote.count(CPU)
        assert mixed.wide.weight.grad is not None
        seen.append((vote.agreed(8), [[round(float(mixed.wide.weight.grad.sum()), 3)]]))
    dist.destroy_process_group()
    out.put((rank, seen))


def test_two_ranks_that_heard_at_different_steps_agree_on_the_same_step() -> None:
    """Rank 1 hears of the round before step 2, rank 0 only before step 4: both read
    "switch" first at step 2; the gradients are DDP's average all along."""
    ballots = {0: [0, 0, 0, 0, 1, 1], 1: [0, 0, 1, 1, 1, 0]}
    got = dict(on_ranks(_rank, 2, ballots, join_timeout=30))
    average = [[1.5, 1.5, 1.5], [1.5, 1.5, 1.5]]  # inputs 1 and 2, d(sum)/dW = input
    switch = [False, False, True, True, True, True]
    for rank in (0, 1):
        agreed = [a for a, _ in got[rank]]
        assert agreed == switch + switch, rank
        assert all(g == average for _, g in got[rank][:6:2]), got[rank]
    assert [g for _, g in got[0][6:]] == [g for _, g in got[1][6:]]  # averaged alike


def test_a_rank_told_to_stop_makes_the_vote_a_stop_and_never_rides_on_gradients(
    world_of_one: None,
) -> None:
    # a sharded model's ranks save together: one told to stop (SIGTERM) says so in the
    # vote, read when counted, so it is sent alone, never appended to a gradient bucket
    vote, told = SwitchVote(), [False]
    vote.stopping = lambda: told[0]
    grads = torch.zeros(3)
    vote.cast(0, 3)
    assert vote.carry(grads) is grads
    vote.count(CPU)
    assert not vote.stop_agreed(3)
    told[0] = True
    vote.cast(0, 3)
    vote.count(CPU)
    assert vote.stop_agreed(3) and not vote.agreed(3)  # a stop is not a switch
    assert not vote.stop_agreed(4)
    told[0] = False  # a later vote without it: no stop
    vote.cast(0, 3)
    vote.count(CPU)
    assert not vote.stop_agreed(3)
