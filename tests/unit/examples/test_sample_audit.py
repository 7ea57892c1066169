"""sample_audit: the rule 'every sample once per epoch, every step one full group',
checked on records built by hand, including the ones it must refuse."""

from __future__ import annotations

from elasticjob_examples.sample_audit import Samples, audit, parse, parse_all


def line(step: int, epoch: int, world: int, rank: int, idx: list[int], t: float) -> str:
    ids = ",".join(map(str, idx))
    return f"samples step={step} epoch={epoch} world={world} rank={rank} idx={ids} t={t:.3f}"


def run(*steps: tuple[int, int, list[list[int]], float]) -> list[Samples]:
    """(step, epoch, per-rank indices, t) -> the records every rank would log."""
    out = []
    for step, epoch, ranks, t in steps:
        for rank, idx in enumerate(ranks):
            out.append(parse(line(step, epoch, len(ranks), rank, idx, t + rank * 0.01)))
    return [r for r in out if r is not None]


def test_parse_reads_a_line_and_ignores_others() -> None:
    got = parse("samples step=3 epoch=0 world=2 rank=1 idx=4,5 t=12.5")
    assert got == Samples(3, 0, 2, 1, (4, 5), 12.5)
    assert parse("step=3 epoch=0 loss=1.0") is None
    assert parse("samples step=3 epoch=0 world=2") is None  # torn
    assert parse_all(["x", "samples step=1 epoch=0 world=1 rank=0 idx= t=1"])[0].idx == ()


def test_a_resize_inside_an_epoch_that_covers_every_sample_once_passes() -> None:
    records = run(
        (1, 0, [[0, 1], [2, 3]], 1.0),
        (2, 0, [[4], [5], [6]], 2.0),  # grew to 3 mid-epoch
        (3, 0, [[7]], 3.0),  # shrank to 1
        (4, 1, [[3], [1]], 4.0),  # the next epoch, partly done
    )
    found = audit(records, samples=8, steps=4)
    assert found.problems == []
    assert found.worlds == [2, 3, 1, 2] and found.epochs == 2
    assert found.resized_in_epoch == {0}


def test_a_step_redone_after_a_restart_counts_once() -> None:
    first = run((1, 0, [[0, 1]], 1.0), (2, 0, [[2, 3]], 2.0))
    redone = run((2, 0, [[2, 3]], 10.0), (3, 0, [[4, 5]], 11.0))
    assert audit(first + redone, samples=6, steps=3).problems == []


def test_a_repeated_sample_a_skipped_one_and_a_missing_step_are_each_named() -> None:
    records = run(
        (1, 0, [[0, 1]], 1.0),
        (2, 0, [[1, 2]], 2.0),  # 1 again, 3 never: the epoch ends at step 3
        (4, 1, [[0, 1]], 4.0),  # step 3 has no record
    )
    problems = audit(records, samples=4, steps=4).problems
    assert "1 steps have no record (first [3])" in problems
    assert "epoch 0: 1 samples repeated" in problems
    assert "epoch 0: 1 samples skipped" in problems


def test_a_step_whose_ranks_are_not_one_group_is_named() -> None:
    records = run((1, 0, [[0], [1]], 1.0))[:1]  # rank 1 of 2 never logged
    assert audit(records, samples=2, steps=1).problems == [
        "step 1: ranks (rank, world) [(0, 2)] are not one full group"
    ]
