"""The restore side's decisions: which checkpoint to try first, which rank sends, and
what a restore loads into which object."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elasticjob_runtime.checkpoints.format import Checkpoint, CheckpointError
from elasticjob_runtime.checkpoints.restore import load_into, reading_order, source_rank

MEMORY, DISK = Path("/dev/shm/job"), Path("/ckpt")


def test_newest_step_first_and_node_memory_first_at_equal_step() -> None:
    order = reading_order([(MEMORY, [5]), (DISK, [3, 4, 5])])
    assert order == [(5, MEMORY), (5, DISK), (4, DISK), (3, DISK)]


def test_nothing_to_read_is_an_empty_order() -> None:
    assert reading_order([(MEMORY, []), (DISK, [])]) == []


@pytest.mark.parametrize(
    ("steps", "src"),
    [
        ([-1, -1, -1], None),  # a fresh start everywhere
        ([7, 7], None),  # every rank holds the newest
        ([7, -1, 9, 9], 2),  # the lowest rank with the newest sends
        ([-1, 3], 1),
    ],
)
def test_the_lowest_rank_holding_the_newest_step_sends_it(
    steps: list[int], src: int | None
) -> None:
    assert source_rank(steps) == src


def test_only_targets_with_load_state_dict_load_their_entry() -> None:
    model = torch.nn.Linear(2, 1)
    saved = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    counters = {"seen": 1}
    load_into({"model": model, "counters": counters}, Checkpoint(4, {"model": saved}, DISK))
    assert all(torch.equal(v, torch.zeros_like(v)) for v in model.state_dict().values())
    assert counters == {"seen": 1}


def test_a_target_missing_from_the_checkpoint_names_the_key_and_what_there_is() -> None:
    ckpt = Checkpoint(4, {"optim": {}}, DISK / "step-4.pt")
    with pytest.raises(CheckpointError, match=r"has no 'model' entry \(it has \['optim'\]\)"):
        load_into({"model": torch.nn.Linear(2, 1)}, ckpt)
