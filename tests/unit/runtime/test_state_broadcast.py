"""One rank's state on every rank as a skeleton and raw tensor bytes
(checkpoints/state_broadcast.py): the bucket plan, and the broadcast over a real gloo group
compared leaf by leaf with what ``torch.save`` bytes used to carry."""

from __future__ import annotations

import io
from collections import OrderedDict, namedtuple
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from spawned_ranks import on_ranks
from torch import nn

from elasticjob_runtime.checkpoints.format import state_to_save
from elasticjob_runtime.checkpoints.state_broadcast import (
    ALIGN,
    SLOT,
    TensorShape,
    is_slot,
    map_tensors,
    plan_buckets,
    read_skeleton,
    sent_as_bytes,
    skeleton_of,
)
from elasticjob_runtime.training.agreement import gather_rows
from elasticjob_runtime.training.state import TrainingState

Pair = namedtuple("Pair", "left right")


@settings(deadline=None)  # no wall-clock bound: the suites share two cores
@given(st.lists(st.integers(0, 300), max_size=40), st.integers(64, 256))
def test_a_plan_holds_every_tensor_once_in_order_aligned_and_within_its_bucket(
    sizes: list[int], limit: int
) -> None:
    buckets = plan_buckets(sizes, limit, align=16)
    order = [index for bucket in buckets for index, _ in bucket.parts]
    assert order == list(range(len(sizes)))
    for bucket in buckets:
        end = 0
        for index, offset in bucket.parts:
            assert offset % 16 == 0 and offset >= end
            end = offset + sizes[index]
        assert end == bucket.size
        assert bucket.size <= limit or len(bucket.parts) == 1  # only a big one goes alone


def test_a_tensor_larger_than_a_bucket_is_a_bucket_of_exactly_its_size() -> None:
    buckets = plan_buckets([10, 500, 20], limit=100)
    assert [(b.size, b.parts) for b in buckets] == [
        (10, ((0, 0),)),
        (500, ((1, 0),)),
        (20, ((2, 0),)),
    ]
    assert plan_buckets([10, 20])[0].parts == ((0, 0), (1, ALIGN))


def test_only_plain_dense_tensors_travel_as_bytes() -> None:
    assert sent_as_bytes(torch.ones(2)) and sent_as_bytes(nn.Parameter(torch.ones(2)))
    assert not sent_as_bytes(torch.ones(2).to_sparse())
    assert not sent_as_bytes(3) and not sent_as_bytes([torch.ones(1)])


def test_the_walk_keeps_containers_their_order_and_a_modules_metadata() -> None:
    sd = nn.BatchNorm1d(3).state_dict()
    walked = map_tensors({"bn": sd, "pair": Pair(torch.ones(1), [2, (torch.zeros(2),)])}, str)
    assert isinstance(walked["bn"], OrderedDict)
    assert list(walked["bn"]) == list(sd) and walked["bn"]._metadata == sd._metadata
    assert isinstance(walked["pair"], Pair) and walked["pair"].right == [2, ("tensor([0., 0.])",)]


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optimizer


def _state() -> dict[str, Any]:
    """Every kind of leaf a state holds: a module's (with ``_metadata``) and an
    optimizer's (its CPU ``step``) state dicts after a step, odd dtypes, 0-dim, empty and
    non-contiguous tensors, a sparse one (inside the skeleton), plain values."""
    model, optimizer = _model_and_optimizer()
    model(torch.randn(4, 6)).square().sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "odd": [
            torch.arange(6, dtype=torch.bfloat16),
            torch.tensor([True, False, True]),
            torch.tensor(7, dtype=torch.int64),
            torch.empty(0, 3),
            torch.arange(12.0).reshape(3, 4).t(),
            torch.ones(3, requires_grad=True),
            torch.eye(2).to_sparse(),
            (1.5, "text"),
            None,
        ],
    }


def _saved(state: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _broadcast(rank: int, port: int, out: Any, bucket_sizes: list[int]) -> None:
    from elasticjob_runtime.checkpoints.state_broadcast import broadcast_state

    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, 3, is_master=rank == 0, timeout=timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
    results = []
    # every rank receives (a broadcast); rank 0 alone (sends to it; rank 2 takes no part)
    for receivers in (None, [0]):
        for bucket_bytes in bucket_sizes:
            sent = _state() if rank == 1 else None
            cpu = torch.device("cpu")
            got = broadcast_state(sent, 1, cpu, receivers=receivers, bucket_bytes=bucket_bytes)
            kept = got if sent is None else sent  # the sender's own, to compare against
            kept_bytes = None if kept is None else _saved(kept)
            results.append((got is None, kept_bytes, _storage_sizes(got)))
    out.put((rank, results, _newcomer(rank)))
    dist.destroy_process_group()


class _Runs:
    """The one spawned group both broadcast tests read (a group costs seconds to spawn)."""

    def __init__(self) -> None:
        self._got: list[Any] | None = None

    def ranks(self) -> list[Any]:
        if self._got is None:
            self._got = on_ranks(_broadcast, 3, [1 << 26, 40])
        return self._got


_RUNS = _Runs()


def _storage_sizes(state: Any) -> list[tuple[int, int]]:
    """Each tensor's storage size beside its own: equal where no bucket is kept alive."""
    sizes: list[tuple[int, int]] = []
    map_tensors(
        state, lambda t: sizes.append((t.untyped_storage().nbytes(), t.numel() * t.element_size()))
    )
    return sizes


def _leaves_equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert a.device == b.device and a.requires_grad == b.requires_grad
        assert torch.equal(a.to_dense(), b.to_dense())
        return
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b) and getattr(a, "_metadata", None) == getattr(b, "_metadata", None)
        for key in a:
            _leaves_equal(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _leaves_equal(x, y)
    else:
        assert a == b


def test_a_skeleton_holds_one_slot_per_tensor_and_a_table_of_their_shapes() -> None:
    """The header the sender pickles (no tensor in it, each a shared slot) and what the
    receiver reads back: the same containers, each slot's shape, dtype and device."""
    weight = nn.Parameter(torch.ones(3, 2))
    state = {
        "model": OrderedDict(w=weight, b=torch.zeros(2, dtype=torch.bfloat16)),
        "optim": {"state": {0: {"step": torch.tensor(4.0)}}, "param_groups": [{"lr": 0.1}]},
        "ints": [1, (2, 3)],
    }
    header, tensors = skeleton_of(state)
    assert [t.shape for t in tensors] == [(3, 2), (2,), ()]
    skeleton, table = read_skeleton(header, "rank 0")
    assert skeleton["optim"]["param_groups"] == [{"lr": 0.1}] and skeleton["ints"] == [1, (2, 3)]
    slots: list[object] = []
    map_tensors(skeleton, slots.append, is_slot)
    assert len(slots) == 3 and all(slot is slots[0] for slot in slots)
    assert table == [
        TensorShape((3, 2), torch.float32, True, True),
        TensorShape((2,), torch.bfloat16, False, True),
        TensorShape((), torch.float32, False, True),
    ]
    assert [entry.nbytes for entry in table] == [24, 4, 4]
    assert SLOT is not slots[0]  # a slot read back is the receiver's own instance


def test_a_peer_that_names_no_dtype_is_refused() -> None:
    """The table is data from another process: a name is taken only if it is a dtype."""
    assert TensorShape.decoded([[2], "int64", False, True]).dtype == torch.int64
    for name in ("load", "__import__", "no_such"):
        try:
            TensorShape.decoded([[2], name, False, True])
        except ValueError as exc:
            assert "no torch dtype" in str(exc)
        else:
            raise AssertionError(f"{name!r} was taken for a dtype")


def test_every_rank_gets_the_senders_state_leaf_for_leaf_in_one_or_many_buckets() -> None:
    # one bucket; a bucket per few tensors, with the big ones alone
    # compared with what the sender held, not with a state rebuilt here: a gradient's last
    # bits depend on the process's thread count, and AdamW's first step magnifies them
    got = {rank: results for rank, results, _ in _RUNS.ranks()}
    assert len(got[0]) == 4
    for case, ((_, first, sizes), (none_back, sent, _), (_, third, _)) in enumerate(
        zip(got[0], got[1], got[2], strict=True)
    ):
        assert none_back and sent is not None  # the sender gets nothing back
        expected = torch.load(io.BytesIO(sent), weights_only=True)
        for received in (first, third) if case < 2 else (first,):
            assert received is not None
            _leaves_equal(torch.load(io.BytesIO(received), weights_only=True), expected)
        assert len(sizes) > 20 and all(own == size for own, size in sizes)
        assert case < 2 or third is None  # not a receiver: it takes no part


def _newcomer(rank: int) -> tuple[str, bytes]:
    """Two survivors and a newcomer share the newest state (TrainingState.share_newest)."""
    model, optimizer = _model_and_optimizer()
    state = TrainingState()
    state.module, state.optimizer = model, optimizer
    if rank < 2:  # two survivors have trained a step; the newcomer's AdamW has no state yet
        model(torch.randn(4, 6)).sum().backward()
        optimizer.step()
        state.step, state.live = 1, True
    ckpt: Any = None  # read only when no rank holds a step in memory
    steps = [row[0] for row in gather_rows([state.held_step], torch.device("cpu"))]
    resumed = state.share_newest(rank, steps, torch.device("cpu"), ckpt)
    objects = state_to_save(state.objects())
    return resumed, _saved({k: objects[k] for k in ("model", "optim", "run")})


def test_a_newcomer_with_an_empty_optimizer_ends_with_a_survivors_state() -> None:
    got = {rank: newcomer for rank, _, newcomer in _RUNS.ranks()}
    assert [got[r][0] for r in range(3)] == [
        "own memory at step 1",
        "own memory at step 1",
        "rank 0 at step 1",
    ]
    survivor, newcomer = (torch.load(io.BytesIO(got[r][1]), weights_only=True) for r in (0, 2))
    _leaves_equal(newcomer, survivor)
