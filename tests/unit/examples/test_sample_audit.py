"""sample_audit: the rule 'every sample once per epoch, every step one full group that
committed', checked on records built by hand, including the ones it must refuse."""

from __future__ import annotations

from elasticjob_examples.sample_audit import (
    Committed,
    Record,
    Samples,
    audit,
    committed_attempts,
    committed_line,
    parse,
    parse_all,
    samples_line,
)


def attempt(
    step: int,
    epoch: int,
    ranks: list[list[int]],
    t: float,
    round_id: str = "r/1",
    commit: bool = True,
) -> list[Record]:
    """What every rank logs in one attempt at ``step`` (``ranks``: each rank's indices):
    its samples as the step starts and, when it committed, its commit."""
    lines = [
        samples_line(step, epoch, len(ranks), rank, round_id, idx, t + rank * 0.01)
        for rank, idx in enumerate(ranks)
    ]
    if commit:
        lines += [committed_line(step, round_id, rank, t + 0.1) for rank in range(len(ranks))]
    return parse_all(lines)


def test_parse_reads_both_lines_and_ignores_others() -> None:
    got = parse("samples step=3 epoch=0 world=2 rank=1 round=j/4 idx=4,5 t=12.5")
    assert got == Samples(3, 0, 2, 1, "j/4", (4, 5), 12.5)
    assert parse("committed step=3 round=j/4 rank=1 t=12.6") == Committed(3, "j/4", 1, 12.6)
    assert parse("step=3 epoch=0 loss=1.0") is None
    assert parse("samples step=3 epoch=0 world=2") is None  # torn
    assert parse("samples step=3 epoch=0 world=2 rank=1 idx=4,5 t=12.5") is None  # no round
    assert parse_all(["x", "samples step=1 epoch=0 world=1 rank=0 round=a idx= t=1"]) == [
        Samples(1, 0, 1, 0, "a", (), 1.0)
    ]


def test_a_resize_inside_an_epoch_that_covers_every_sample_once_passes() -> None:
    records = [
        *attempt(1, 0, [[0, 1], [2, 3]], 1.0),
        *attempt(2, 0, [[4], [5], [6]], 2.0, "r/2"),  # grew to 3 mid-epoch
        *attempt(3, 0, [[7]], 3.0, "r/3"),  # shrank to 1
        *attempt(4, 1, [[3], [1]], 4.0, "r/4"),  # the next epoch, partly done
    ]
    found = audit(records, samples=8, steps=4)
    assert found.problems == []
    assert found.worlds == [2, 3, 1, 2] and found.epochs == 2
    assert found.resized_in_epoch == {0}


def test_a_step_redone_after_a_restart_counts_once_and_its_last_attempt_stands() -> None:
    first = attempt(1, 0, [[0, 1]], 1.0) + attempt(2, 0, [[2, 3]], 2.0)
    redone = attempt(2, 0, [[2, 3]], 10.0, "r/2") + attempt(3, 0, [[4, 5]], 11.0, "r/2")
    assert audit(first + redone, samples=6, steps=3).problems == []
    assert {s: len(tries) for s, tries in committed_attempts(first + redone).items()} == {
        1: 1,
        2: 2,
        3: 1,
    }


def test_a_rank_killed_after_its_collective_still_counts_in_the_step_its_peer_committed() -> None:
    # Rank 0 logged its batch, joined the allreduce and died before committing; rank 1
    # committed the step with rank 0's gradients in it (the soak saw this).
    lines = [
        samples_line(1, 0, 2, 0, "r/1", [0, 1], 1.0),
        samples_line(1, 0, 2, 1, "r/1", [2, 3], 1.0),
        committed_line(1, "r/1", 1, 1.1),
        *[samples_line(2, 0, 2, r, "r/2", [4 + r], 2.0) for r in range(2)],
        *[committed_line(2, "r/2", r, 2.1) for r in range(2)],
    ]
    assert audit(parse_all(lines), samples=6, steps=2).problems == []


def test_a_dropped_attempt_redone_in_the_next_round_within_the_second_counts_once() -> None:
    dropped = attempt(1, 0, [[0, 1], [2, 3]], 1.0, "r/1", commit=False)
    redone = attempt(1, 0, [[0, 1, 2, 3]], 1.3, "r/2")  # the survivor alone, 0.3 s later
    found = audit(dropped + redone, samples=4, steps=1)
    assert found.problems == [] and found.worlds == [1]


def test_a_repeated_sample_a_skipped_one_and_a_missing_step_are_each_named() -> None:
    records = [
        *attempt(1, 0, [[0, 1]], 1.0),
        *attempt(2, 0, [[1, 2]], 2.0),  # 1 again, 3 never: the epoch ends at step 3
        *attempt(3, 0, [[3]], 3.0, commit=False),  # dropped and never redone
        *attempt(4, 1, [[0, 1]], 4.0),
    ]
    problems = audit(records, samples=4, steps=4).problems
    assert "1 steps have no committed record (first [3])" in problems
    assert "epoch 0: 1 samples repeated" in problems
    assert "epoch 0: 1 samples skipped" in problems


def test_a_step_whose_ranks_are_not_one_group_is_named() -> None:
    records = [r for r in attempt(1, 0, [[0], [1]], 1.0) if r.rank == 0]  # rank 1 said nothing
    assert audit(records, samples=2, steps=1).problems == [
        "step 1: ranks (rank, world) [(0, 2)] are not one full group"
    ]
