"""Moving training state between the ranks of the default process group.

A rank that lacks the newest step (a node that joined with an empty node-local
directory, a worker regrouped in place) gets it from a peer: the ranks first gather
which step each holds, then one rank broadcasts it: a whole training state as raw tensor
bytes (:mod:`elasticjob_runtime.checkpoints.state_broadcast`), smaller things (a
checkpoint file read by one rank, a ledger, a round's token) as bytes from here.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch


def group_device() -> torch.device:
    """Where the default group's collectives want their tensors."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_steps(mine: int, device: torch.device) -> list[int]:
    """Every rank's ``mine`` (a step, -1 for none), in rank order."""
    import torch.distributed as dist

    tensor = torch.tensor([mine], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return [int(t.item()) for t in gathered]


def broadcast_bytes(data: bytes, src: int, device: torch.device) -> bytes:
    """``data`` of rank ``src``, on every rank (plain tensor collectives: torch's object
    collectives need numpy, which a slim image may not have)."""
    import torch.distributed as dist

    return move_bytes(data, src, device, lambda tensor: dist.broadcast(tensor, src))


def broadcast_sized(data: bytes, size: int, src: int, device: torch.device) -> bytes:
    """``data`` of rank ``src`` on every rank, when every rank knows its ``size`` already
    (gathered beforehand): one collective instead of :func:`broadcast_bytes`'s two."""
    import torch.distributed as dist

    return _move_payload(data, size, src, device, lambda tensor: dist.broadcast(tensor, src))


def move_bytes(
    data: bytes, src: int, device: torch.device, move: Callable[[torch.Tensor], object]
) -> bytes:
    """``data`` of rank ``src`` on each rank that ``move`` (a broadcast, or a send to some
    ranks) carries a tensor to: its size first, then its bytes."""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    move(size)
    return _move_payload(data, int(size.item()), src, device, move)


def _move_payload(
    data: bytes,
    size: int,
    src: int,
    device: torch.device,
    move: Callable[[torch.Tensor], object],
) -> bytes:
    """The ``size`` bytes of ``data`` (rank ``src``'s) on each rank ``move`` reaches."""
    import torch.distributed as dist

    if dist.get_rank() == src:
        if len(data) != size:
            raise ValueError(f"rank {src} has {len(data)} bytes to send, its peers expect {size}")
        if size:  # nothing to send is no message
            move(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device))
        return data
    if not size:
        return b""
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    move(buf)
    host = buf.cpu().contiguous()
    return ctypes.string_at(host.data_ptr(), host.numel())
