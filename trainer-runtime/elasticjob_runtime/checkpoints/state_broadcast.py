"""One rank's whole state on every rank: its tensors as raw bytes, the rest as a skeleton.

A joiner used to get a peer's state as ``torch.save`` bytes: the sender pickled every
tensor into one bytes object and copied it into a tensor, the receiver copied it out and
unpickled it. For the realistic example's 53 MB (model, AdamW's moments, an EMA) that was
150 ms of copying and pickling around a 19 ms broadcast, on the two cores the training
needs, while the group waited. Here the sender splits the state into a *skeleton* (the
same containers, pickled by ``torch.save`` and loaded with torch's safe loader as
before) and the tensors themselves, which travel as their raw bytes in a few buckets of
at most :data:`BUCKET_BYTES`: one copy into a bucket on the sender, one out of it on the
receiver (none for a tensor that fills a bucket of its own), and no pickling of data.

The buckets are small (4 MiB) and pipelined: the sender fills the next while
:data:`IN_FLIGHT` are on the wire, and the receiver has the next ones posted while it
copies the tensors out of the last. One 64 MiB bucket used to cost each side fresh
pages for the whole state, every time (glibc maps an allocation that large anew): 13,000
page faults on the sender and 26,000 on a new receiver for the realistic example, where
a fault is expensive (a VM, two busy cores). Small buckets reuse the heap's freed pages
(the receiver still faults once for the tensors it keeps), and copying overlaps the wire.
Beside two busy processes the realistic state reached a new process in 0.23 s instead
of 0.29, and a survivor that sends it again spent 0.12 s instead of 0.17 (medians,
``python -m bench.state_transfer_cost``).

In the skeleton each such tensor is one shared :class:`TensorSlot` (pickled once, then
referenced), and the tensors' shapes and dtypes travel beside it as one JSON string, in
the order both sides walk the containers. torch's safe loader is Python, and a ``meta``
tensor in each place made the realistic example's skeleton of 448 tensors cost 76 ms to
build, save and load; this one costs 11 ms (docs/recovery.md).

Only plain strided tensors go as bytes; anything else (a tensor subclass, a sparse or
quantized tensor, an object the safe loader knows) stays inside the skeleton, exactly as
``torch.save`` sent it before. A tensor that sat on the CPU at the sender is put on the
receiver's CPU, so an optimizer's ``step`` counter stays where a checkpoint puts it; the
others arrive on the group's device, where ``load_state_dict`` takes them from.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from elasticjob_runtime.checkpoints.format import deserialize, serialize
from elasticjob_runtime.checkpoints.state_transfer import move_bytes

if TYPE_CHECKING:
    from torch.distributed import Work

BUCKET_BYTES = 1 << 22  # 4 MiB: small enough to reuse the heap's freed pages, large
# enough that a message's fixed cost (about 0.5 ms with gloo here) stays small
IN_FLIGHT = 2  # buckets on the wire while the next is filled or the last emptied
ALIGN = 64  # every tensor's bytes start at a multiple of this in its bucket
_STATE_KEY = "state"
_TABLE_KEY = "tensors"  # JSON: [[shape, dtype name, requires_grad, on the sender's CPU], ...]


class TensorSlot:
    """Where a tensor sent as bytes sits in a skeleton (one shared instance, :data:`SLOT`)."""


SLOT = TensorSlot()


@dataclass(frozen=True)
class Bucket:
    """One broadcast: ``size`` bytes holding the tensors ``(index, offset)``."""

    size: int
    parts: tuple[tuple[int, int], ...]


def plan_buckets(
    sizes: Sequence[int], limit: int = BUCKET_BYTES, align: int = ALIGN
) -> list[Bucket]:
    """The tensors (their byte sizes, in order) packed in order into buckets of at most
    ``limit`` bytes, each start aligned to ``align``; a tensor larger than ``limit`` is a
    bucket of its own, of exactly its size. Pure: both sides compute the same plan."""
    buckets: list[Bucket] = []
    parts: list[tuple[int, int]] = []
    end = 0
    for index, size in enumerate(sizes):
        if size > limit:
            if parts:
                buckets.append(Bucket(end, tuple(parts)))
                parts, end = [], 0
            buckets.append(Bucket(size, ((index, 0),)))
            continue
        start = -(-end // align) * align
        if parts and start + size > limit:
            buckets.append(Bucket(end, tuple(parts)))
            parts, start = [], 0
        parts.append((index, start))
        end = start + size
    if parts:
        buckets.append(Bucket(end, tuple(parts)))
    return buckets


def sent_as_bytes(value: object) -> bool:
    """Whether a leaf travels as raw bytes (a plain dense tensor), not inside the skeleton."""
    return (
        type(value) in (torch.Tensor, torch.nn.Parameter)
        and value.layout == torch.strided  # type: ignore[attr-defined]
        and not value.is_quantized  # type: ignore[attr-defined]
    )


def map_tensors(
    obj: Any, fn: Callable[[Any], Any], leaf: Callable[[object], bool] = sent_as_bytes
) -> Any:
    """``obj`` with ``fn`` applied to every ``leaf`` (default: each :func:`sent_as_bytes`),
    walking dicts (an ``OrderedDict``'s ``_metadata`` kept: modules' ``load_state_dict``
    reads it), lists and tuples in their order, which a pickled skeleton keeps."""
    if leaf(obj):
        return fn(obj)
    if isinstance(obj, dict):
        out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for key, value in obj.items():
            out[key] = map_tensors(value, fn, leaf)
        metadata = getattr(obj, "_metadata", None)
        if metadata is not None and isinstance(out, OrderedDict):
            out._metadata = metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [map_tensors(value, fn, leaf) for value in obj]
    if isinstance(obj, tuple):
        items = [map_tensors(value, fn, leaf) for value in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return obj


def is_slot(value: object) -> bool:
    return isinstance(value, TensorSlot)


@dataclass(frozen=True)
class TensorShape:
    """What the receiver makes of a slot's bytes."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    on_cpu: bool  # it sat on the sender's CPU: it lands on the receiver's

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def encoded(self) -> list[Any]:
        return [
            list(self.shape),
            str(self.dtype).removeprefix("torch."),
            self.requires_grad,
            self.on_cpu,
        ]

    @staticmethod
    def decoded(entry: Sequence[Any]) -> TensorShape:
        shape, name, requires_grad, on_cpu = entry
        dtype = getattr(torch, str(name), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"a peer's state names {name!r}, which is no torch dtype")
        return TensorShape(tuple(int(n) for n in shape), dtype, bool(requires_grad), bool(on_cpu))


def skeleton_of(state: Mapping[str, Any]) -> tuple[bytes, list[torch.Tensor]]:
    """The sender's header (skeleton and tensor table, serialized) and its tensors, in
    the order of the table."""
    tensors: list[torch.Tensor] = []

    def to_slot(tensor: torch.Tensor) -> TensorSlot:
        tensors.append(tensor)
        return SLOT

    skeleton = map_tensors(dict(state), to_slot)
    table = [
        TensorShape(tuple(t.shape), t.dtype, t.requires_grad, t.device.type == "cpu").encoded()
        for t in tensors
    ]
    return serialize({_STATE_KEY: skeleton, _TABLE_KEY: json.dumps(table)}), tensors


def read_skeleton(header: bytes, source: str) -> tuple[Any, list[TensorShape]]:
    """The receiver's side of :func:`skeleton_of`: the skeleton, and each slot's tensor."""
    with torch.serialization.safe_globals([TensorSlot]):
        loaded = deserialize(header, source=source)
    table = [TensorShape.decoded(entry) for entry in json.loads(loaded[_TABLE_KEY])]
    slots: list[object] = []
    map_tensors(loaded[_STATE_KEY], slots.append, is_slot)
    if len(slots) != len(table):
        raise ValueError(f"{source}'s state has {len(slots)} tensors but lists {len(table)}")
    return loaded[_STATE_KEY], table


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _as_bytes(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The tensor's bytes, flat, on ``device``."""
    return tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8)


def broadcast_state(
    state: Mapping[str, Any] | None,
    src: int,
    device: torch.device,
    *,
    receivers: Sequence[int] | None = None,
    bucket_bytes: int = BUCKET_BYTES,
) -> dict[str, Any] | None:
    """Rank ``src``'s ``state`` (a mapping of state dicts; None on the other ranks), a
    copy of it returned on each of ``receivers`` (default: every other rank), None on
    ``src`` and on the ranks that take no part. Every rank must call it with the same
    ``src`` and ``receivers``; when some ranks need nothing (survivors beside a joiner)
    the bytes go to the receivers alone, so a joiner's copy costs the same at any size."""
    import torch.distributed as dist

    rank = dist.get_rank()
    others = [r for r in range(dist.get_world_size()) if r != src]
    wanted = others if receivers is None else sorted(set(receivers) - {src})
    if rank != src and rank not in wanted:
        return None
    move = _Move(src, None if wanted == others else wanted)
    sending = rank == src
    tensors: list[torch.Tensor] = []
    header = b""
    if sending:
        assert state is not None
        header, tensors = skeleton_of(state)
    received = move.bytes(header, device)
    table: list[TensorShape] = []
    if not sending:
        skeleton, table = read_skeleton(received, f"rank {src}")
    sizes = [_nbytes(t) for t in tensors] if sending else [entry.nbytes for entry in table]
    buckets = plan_buckets(sizes, bucket_bytes)
    if sending:
        _send(buckets, tensors, sizes, device, move)
        return None
    arrived: list[torch.Tensor | None] = [None] * len(sizes)
    for bucket, buffer in _receive(buckets, device, move):
        whole = _alone(bucket, sizes)
        for index, offset in bucket.parts:
            entry = table[index]
            raw = buffer[offset : offset + entry.nbytes]
            tensor = raw.view(entry.dtype).view(entry.shape)
            if entry.on_cpu and tensor.device.type != "cpu":
                tensor = tensor.cpu()
            elif not whole:
                tensor = tensor.clone()  # its own storage: the bucket is freed after this
            arrived[index] = tensor.requires_grad_() if entry.requires_grad else tensor
    taken: Iterator[torch.Tensor | None] = iter(arrived)
    return map_tensors(skeleton, lambda _slot: next(taken), is_slot)  # type: ignore[no-any-return]


def _send(
    buckets: Sequence[Bucket],
    tensors: Sequence[torch.Tensor],
    sizes: Sequence[int],
    device: torch.device,
    move: _Move,
) -> None:
    """Fill the next bucket while the ones before it are on the wire."""
    in_flight: deque[tuple[list[Work], torch.Tensor]] = deque()
    for bucket in buckets:
        buffer = _fill(bucket, tensors, sizes, device)
        in_flight.append((move.start(buffer), buffer))
        if len(in_flight) > IN_FLIGHT:
            _wait(in_flight.popleft()[0])
    while in_flight:
        _wait(in_flight.popleft()[0])


def _receive(
    buckets: Sequence[Bucket], device: torch.device, move: _Move
) -> Iterator[tuple[Bucket, torch.Tensor]]:
    """Each bucket as it arrives, the next ones already being received meanwhile."""
    posted: deque[tuple[Bucket, list[Work], torch.Tensor]] = deque()
    upcoming = iter(buckets)
    while True:
        while len(posted) <= IN_FLIGHT:
            bucket = next(upcoming, None)
            if bucket is None:
                break
            buffer = _empty(bucket, device)
            posted.append((bucket, move.start(buffer), buffer))
        if not posted:
            return
        bucket, works, buffer = posted.popleft()
        _wait(works)
        yield bucket, buffer


def _wait(works: Sequence[Work]) -> None:
    for work in works:
        work.wait()


@dataclass(frozen=True)
class _Move:
    """One tensor from ``src`` to every other rank (a broadcast), or to ``receivers``
    alone (a send to each; gloo's broadcast costs the sender and the wire once per
    rank, needed or not)."""

    src: int
    receivers: Sequence[int] | None  # None: every rank

    def start(self, tensor: torch.Tensor) -> list[Work]:
        """Start moving ``tensor``; it is there once every returned work is waited for
        (an empty one, a bucket of empty tensors only, needs no message)."""
        import torch.distributed as dist

        if not tensor.numel():
            return []
        if self.receivers is None:
            works = [dist.broadcast(tensor, self.src, async_op=True)]
        elif dist.get_rank() != self.src:
            works = [dist.irecv(tensor, self.src)]
        else:
            works = [dist.isend(tensor, dst) for dst in self.receivers]
        return [work for work in works if work is not None]

    def tensor(self, tensor: torch.Tensor) -> None:
        _wait(self.start(tensor))

    def bytes(self, data: bytes, device: torch.device) -> bytes:
        return move_bytes(data, self.src, device, self.tensor)


def _alone(bucket: Bucket, sizes: Sequence[int]) -> bool:
    """Is the bucket exactly one tensor's bytes (sent as they are, kept as received)?"""
    return len(bucket.parts) == 1 and bucket.size == sizes[bucket.parts[0][0]]


def _fill(
    bucket: Bucket, tensors: Sequence[torch.Tensor], sizes: Sequence[int], device: torch.device
) -> torch.Tensor:
    if _alone(bucket, sizes):
        return _as_bytes(tensors[bucket.parts[0][0]], device)
    buffer = torch.zeros(bucket.size, dtype=torch.uint8, device=device)
    for index, offset in bucket.parts:
        tensor = tensors[index]
        buffer[offset : offset + _nbytes(tensor)] = _as_bytes(tensor, device)
    return buffer


def _empty(bucket: Bucket, device: torch.device) -> torch.Tensor:
    return torch.empty(bucket.size, dtype=torch.uint8, device=device)
