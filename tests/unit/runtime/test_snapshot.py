"""An async save's CPU copy: equal to the state when taken, independent of it afterwards,
and in the previous copy's buffers when the shapes match."""

from __future__ import annotations

import torch

from elasticjob_runtime.checkpoints.snapshot import Snapshots, copy_into


def state(scale: float = 1.0) -> dict[str, object]:
    return {
        "model": {"w": torch.full((4, 3), scale), "b": torch.arange(3.0) * scale},
        "optim": {"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": [{"lr": 0.1}]},
        "meta": ("epoch", 3),
    }


def test_a_snapshot_equals_the_state_and_does_not_follow_it() -> None:
    live = state()
    snap = Snapshots().take(live)
    live["model"]["w"].add_(5)  # type: ignore[index]
    live["optim"]["param_groups"][0]["lr"] = 9.0  # type: ignore[index]
    assert torch.equal(snap["model"]["w"], torch.ones(4, 3))
    assert snap["optim"]["param_groups"][0]["lr"] == 0.1
    assert snap["meta"] == ("epoch", 3) and isinstance(snap["optim"]["state"], dict)


def test_the_next_snapshot_reuses_the_buffers_of_the_same_shapes() -> None:
    snaps = Snapshots()
    first = snaps.take(state())
    ptrs = [first["model"]["w"].data_ptr(), first["model"]["b"].data_ptr()]
    second = snaps.take(state(2.0))
    assert [second["model"]["w"].data_ptr(), second["model"]["b"].data_ptr()] == ptrs
    assert torch.equal(second["model"]["b"], torch.tensor([0.0, 2.0, 4.0]))
    grown = state()
    grown["model"]["w"] = torch.ones(5, 3)  # type: ignore[index]
    third = snaps.take(grown)
    assert third["model"]["w"].data_ptr() != ptrs[0] and third["model"]["w"].shape == (5, 3)
    assert third["model"]["b"].data_ptr() == ptrs[1]
    snaps.release()
    assert snaps.take(state())["model"]["b"].data_ptr() != ptrs[1]


def test_odd_tensors_are_copied_exactly() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    odd = {
        "transposed": base.t(),
        "strided_view": base[:, ::2],
        "empty": torch.empty(0),
        "int": torch.arange(5, dtype=torch.int64),
        "param": torch.nn.Parameter(torch.ones(2)),
        "conj": torch.tensor([1 + 2j]).conj(),
    }
    snaps = Snapshots()
    for _ in range(2):  # fresh buffers, then reused ones
        snap = snaps.take(odd)
        for key, value in odd.items():
            assert torch.equal(snap[key], value.detach().resolve_conj()), key
            assert not snap[key].requires_grad


def test_copy_into_copies_the_bytes() -> None:
    src, dst = torch.randn(1000), torch.zeros(1000)
    copy_into(dst, src)
    assert torch.equal(dst, src)
