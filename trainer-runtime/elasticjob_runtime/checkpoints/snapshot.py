"""The CPU copy an asynchronous save takes of the training state, on the caller's thread.

That copy is all an async save makes training wait for, so it must cost no more than
copying the bytes. Two things made it cost as much as a synchronous ``torch.save`` (1 GB
of model + Adam state: 2.8 s against 2.4 s, ``bench/checkpoint_stall.py``):

* fresh CPU tensors on every save: every page of them is faulted in and zeroed by the
  kernel first (about 1 s per GB here). A training loop saves the same shapes every time,
  so :class:`Snapshots` copies into the previous save's tensors; the manager allows one
  save in flight, so the writer that read them has finished. The price is one CPU copy of
  the state held between saves.
* ``Tensor.copy_`` on CPU splits each copy over torch's intra-op threads; with the cores
  busy (the training's own threads, a loaded node) each of the hundreds of per-tensor
  parallel regions waits for a descheduled thread, and the copy took ten times as long.
  Contiguous CPU tensors are copied with one ``memmove`` instead.

GPU tensors are copied into pinned (page-locked) CPU buffers, all copies queued without
waiting and one wait at the end: from pageable memory CUDA copies through a staging buffer
of its own, a copy at a time, at a fraction of the link's speed (bench/gpu.py measures it).
"""

from __future__ import annotations

import copy
import ctypes
from typing import Any

import torch


def _reusable(old: torch.Tensor | None, src: torch.Tensor) -> bool:
    return (
        old is not None
        and old.shape == src.shape
        and old.dtype == src.dtype
        and old.stride() == src.stride()
        and (src.device.type != "cuda" or old.is_pinned())
    )


def _plain(t: torch.Tensor) -> bool:
    """A dense tensor whose bytes are its values: copyable into a buffer of its own kind."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and not t.is_quantized
    )


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, as one memmove where both are contiguous CPU tensors."""
    if (
        src.device.type == "cpu"
        and src.is_contiguous()
        and dst.is_contiguous()
        and not (src.is_conj() or src.is_neg())
        and src.numel() > 0
    ):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    else:
        dst.copy_(src)


class Snapshots:
    """Deep copies of state dicts with every tensor on CPU, in buffers reused from the
    previous copy (matched by position, shape, dtype and strides).

    A snapshot's tensors are overwritten by the next one: take the next only once nothing
    reads the previous (:class:`~elasticjob_runtime.checkpoints.manager.CheckpointManager` waits for
    the save in flight first).
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = []
        self._queued: set[torch.device] = set()  # GPUs with copies not yet waited for

    def take(self, obj: Any) -> Any:
        """``obj`` with containers rebuilt, tensors copied to CPU, other values deep-copied."""
        used: list[torch.Tensor | None] = []
        self._queued.clear()
        out = self._copy(obj, used)
        for device in self._queued:  # the copies from each GPU were queued, not waited for
            torch.cuda.synchronize(device)
        self._buffers = used
        return out

    def release(self) -> None:
        """Drop the kept buffers (the memory of one copy of the state)."""
        self._buffers = []

    def _copy(self, obj: Any, used: list[torch.Tensor | None]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, used)
        if isinstance(obj, dict):
            return type(obj)((k, self._copy(v, used)) for k, v in obj.items())
        if isinstance(obj, list):
            return [self._copy(v, used) for v in obj]
        if isinstance(obj, tuple):
            return tuple(self._copy(v, used) for v in obj)
        return copy.deepcopy(obj)

    def _tensor(self, src: torch.Tensor, used: list[torch.Tensor | None]) -> torch.Tensor:
        src = src.detach()
        index = len(used)
        if not _plain(src):
            used.append(None)
            return src.to("cpu", copy=True)
        old = self._buffers[index] if index < len(self._buffers) else None
        buf = old if old is not None and _reusable(old, src) else None
        on_gpu = src.device.type == "cuda"
        if buf is None:
            buf = torch.empty_like(src, device="cpu", pin_memory=on_gpu)
            if buf.stride() != src.stride():  # not dense: copy_ lays it out contiguous
                used.append(None)
                return src.to("cpu", copy=True)
        if on_gpu:
            buf.copy_(src, non_blocking=True)  # into pinned memory: take() waits once
            self._queued.add(src.device)
        else:
            copy_into(buf, src)
        used.append(buf)
        return buf
