"""A new worker's heap, grown while it waits for the rest of its first group.

A process that has never trained a step meets its step's working memory (the state a
peer sends it, the activations, the optimizer's moments) on pages the kernel has never
given it, one page fault per 4 KiB, and its peers wait for it in the step's all-reduce:
the realistic example's joiner took 37,862 page faults in its first step against 30 two
steps later (bench/README.md). Grown ahead, those pages are there when the step needs
them.

**Only while it waits.** A joiner reaches its group while the survivors still train the
step they switch after, and an early member of a job's first round waits for the late
ones: that time is idle for the process, so it touches heap memory in 1 MiB chunks and
asks, between chunks, whether the others have arrived (:class:`Arrivals`, a counter in
the round's store). The growth ends as the last member arrives, within one chunk. A
replacement for a killed worker arrives last and grows nothing, so no recovery waits
for it. Only a process started into a group that trained before grows (a joiner, a
replacement: the round's cause is not the job's start, where every member starts
together and none waits for another's first step), only in its first group (a
survivor's heap already has its size), and only on gloo: a GPU worker's step lives in
device memory.

**How much.** At most as much again as the heap already holds, and at most 1 GiB: the
heap of a process that built its model, optimizer and loader scales with them, and the
realistic example's joiner held 134 MiB at the wait against 290 MiB once training. It
grew 112-208 MiB in its 0.6-1.3 s wait, took the state from its peer in 0.06-0.09 s
instead of 0.23-0.26 s, and the join paused 1.4-1.5 s instead of 1.85-2.2 s (medians,
bench/README.md). ``ELASTICJOB_WAIT_HEAP_MB`` sets another ceiling; 0 turns it off.

**Why not in the warm spare, before its round.** The script forks its DataLoader's
workers after the spare is handed its round, and every page the trainer writes after a
fork costs a copy: writing 200 MB after a fork took 0.73 s of CPU here against 0.12 s
on fresh pages. Pages grown before that fork cost more than they save.

**glibc keeps what is freed.** The chunks are freed at the end, and glibc is told to keep
them: ``M_TRIM_THRESHOLD`` the heap's grown size, and ``M_MMAP_THRESHOLD`` 32 MiB (setting
either turns off glibc's dynamic threshold, which rises to at most that as blocks are
freed; left at its 128 KiB start, every tensor of a step would be mapped and unmapped
anew). With another allocator (musl, a preloaded jemalloc or tcmalloc) nothing is grown.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from elasticjob_runtime import contract

log = logging.getLogger(__name__)

CHUNK = 1 << 20  # touched between two questions: about 1-3 ms of page faults here
CEILING = 1 << 30
# glibc's mallopt parameters (malloc.h) and the ceiling of its own dynamic mmap threshold
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20


@dataclass(frozen=True)
class Growth:
    """What one wait grew: bytes touched and the seconds it took."""

    grown: int
    seconds: float


def growth_limit(heap: int, ceiling: int = CEILING) -> int:
    """How far a waiting process may grow a heap of ``heap`` bytes: as much again, capped."""
    return max(0, min(heap, ceiling))


def ceiling_from_env(env: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """``ELASTICJOB_WAIT_HEAP_MB`` in bytes (0: off), or :data:`CEILING` when unset;
    ValueError naming the variable when it is not a whole number of MiB."""
    raw = env.get(contract.WAIT_HEAP_MB, "").strip()
    if not raw:
        return CEILING
    try:
        mib = int(raw)
    except ValueError:
        mib = -1
    if mib < 0:
        raise ValueError(
            f"{contract.WAIT_HEAP_MB}={raw!r}: give the most MiB a waiting worker may grow "
            "its heap by, as a whole number (0 turns the growth off)"
        )
    return mib << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


class GlibcHeap:
    """The process's glibc heap: its size, and chunks taken from it and given back."""

    def __init__(self, libc: ctypes.CDLL) -> None:
        self._libc = libc
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.free.restype = None
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.mallinfo2.restype = _MallInfo2

    @staticmethod
    def load() -> GlibcHeap | None:
        """The heap, or None where malloc is not glibc's (musl, a preloaded allocator)."""
        process = ctypes.CDLL(None)
        if not hasattr(process, "gnu_get_libc_version") or not hasattr(process, "mallinfo2"):
            return None
        try:  # glibc's soname (ctypes.util.find_library would run ldconfig to find it)
            libc = ctypes.CDLL("libc.so.6")
        except OSError:
            return None
        address = ctypes.cast(process.malloc, ctypes.c_void_p).value
        if address != ctypes.cast(libc.malloc, ctypes.c_void_p).value:
            return None  # something before libc answers malloc: not glibc's heap
        return GlibcHeap(libc)

    def size(self) -> int:
        """Bytes the main heap holds from the system (mallinfo2's ``arena``)."""
        return int(self._libc.mallinfo2().arena)

    def keep_freed(self, size: int) -> bool:
        """Tell glibc to keep up to ``size`` bytes freed at the heap's top, and to serve
        blocks below :data:`MMAP_THRESHOLD` from the heap (see the module docstring)."""
        return bool(
            self._libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            and self._libc.mallopt(_M_TRIM_THRESHOLD, min(size, 2**31 - 1))
        )

    def touch(self, size: int) -> int:
        """A block of ``size`` bytes, every page written; 0 when malloc refuses."""
        block = self._libc.malloc(size)
        if block:
            ctypes.memset(block, 0, size)
        return int(block or 0)

    def free(self, block: int) -> None:
        self._libc.free(block)


def grow_while(
    waiting: Callable[[], bool], limit: int, heap: GlibcHeap | None, chunk: int = CHUNK
) -> Growth:
    """Touch heap chunks while ``waiting()`` and fewer than ``limit`` bytes are grown,
    then free them into a heap told to keep them. ``waiting`` is asked before the first
    chunk and after each; one that raises ends the growth (the build that follows
    reports the error). Nothing is grown, and glibc is left as it was, when the first
    answer is no."""
    if heap is None or limit < chunk:
        return Growth(0, 0.0)
    started = time.monotonic()
    blocks: list[int] = []
    try:
        if not waiting() or not heap.keep_freed(heap.size() + limit):
            return Growth(0, time.monotonic() - started)
        while len(blocks) * chunk + chunk <= limit:
            block = heap.touch(chunk)
            if not block:
                break
            blocks.append(block)
            if not waiting():
                break
    except Exception as exc:  # the store went away: the build says why
        log.debug("stopped growing the heap: %s", exc)
    finally:
        for block in blocks:
            heap.free(block)
    return Growth(len(blocks) * chunk, time.monotonic() - started)
