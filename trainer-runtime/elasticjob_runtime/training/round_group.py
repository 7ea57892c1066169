"""One round's process group, built from an assignment and abandoned without waiting.

The training-loop API (:mod:`elasticjob_runtime.training.run`) keeps a worker alive across
rounds, so it must leave a process group whose collectives may never finish: a peer
that froze sends no TCP reset, and a gloo collective waits for it until the group's
timeout (30 min by default). :class:`RoundGroup` is the one interface for that:
``build`` a round's default group, ``abort`` it from any thread so that a collective
blocked in it fails now, ``destroy`` what is left.

A build can outlive its round: a worker regrouping into round N connects to the store
that round N's rank 0 serves, and when that rank died before serving it, the agent has
already formed round N+1. TCPStore's client retries its connect for the whole group
timeout; ``build`` connects in short windows instead and gives up with
:class:`RoundSuperseded` once ``superseded()`` says a newer round is there.

A member that asks before rank 0 serves waits for the listener itself, in 5 ms polls,
and only then opens the store: TCPStore's client backs off after a refused connect, and
a replacement that came before a survivor rank 0 served lost 0.3-0.8 s to that backoff
(the worker-kill outlier of issue 36, measured in docs/recovery.md).

* **gloo** has no abort. Every socket the group opened is recorded when it is built
  (the store connection and gloo's full mesh, which it connects eagerly); ``abort``
  shuts them down. The blocked collective's reads fail at once and it raises in the
  training thread; the process stays healthy and builds the next group.
* **NCCL** has an abort (``torch.distributed`` ``_abort_process_group``), which is
  what :class:`NcclRoundGroup` calls. There is no GPU here, so that path is untested;
  docs/recovery.md says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from elasticjob_runtime import contract
from elasticjob_runtime.launch.channel import Assignment
from elasticjob_runtime.launch.torch_internals import (
    abort_process_group,
    forget_failed_group_names,
)
from elasticjob_runtime.training.waiting_heap import (
    GlibcHeap,
    Growth,
    grow_while,
    growth_limit,
)

log = logging.getLogger(__name__)

_SOCKET = re.compile(r"socket:\[(\d+)\]")

# How long one connect to a round's store may take before the build asks whether the
# round is still wanted: long enough that a rank 0 still starting (its imports) costs no
# retry, short enough that a dead one costs seconds, not the group timeout.
STORE_CONNECT_WINDOW_S = 5.0
# How often a member asks whether rank 0 listens yet: a refused connect on loopback or a
# pod network costs microseconds, so 5 ms polls cost nothing and wait at most 5 ms more.
LISTENER_POLL_S = 0.005


class RoundSuperseded(dist.DistError):
    """The round being built was left behind: a newer one was formed, or the agent left."""


def never() -> bool:
    return False


def open_sockets() -> dict[int, int]:
    """This process's socket descriptors: fd -> inode (from /proc/self/fd)."""
    out: dict[int, int] = {}
    fd_dir = Path("/proc/self/fd")
    for entry in fd_dir.iterdir():
        try:
            match = _SOCKET.fullmatch(os.readlink(entry))
        except OSError:
            continue  # closed while we listed
        if match:
            out[int(entry.name)] = int(match.group(1))
    return out


def opened_between(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    """The sockets in ``after`` that ``before`` did not have (a reused fd counts as new)."""
    return {fd: inode for fd, inode in after.items() if before.get(fd) != inode}


def shut_down(sockets: dict[int, int]) -> int:
    """``shutdown(SHUT_RDWR)`` each socket still open as the same inode; returns how many.

    A shutdown acts on the socket, not the descriptor, so it reaches every reader of it
    (gloo's threads) while their descriptors stay valid until gloo closes them. Listening
    sockets are left alone."""
    done = 0
    current = open_sockets()
    for fd, inode in sockets.items():
        if current.get(fd) != inode:
            continue  # closed, or the number now names something else
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                # A listening socket stays: gloo's listener thread treats a failed
                # accept() as fatal and terminates the process.
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                sock.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            continue  # not connected, or already shut
    return done


class RoundGroup(Protocol):
    """The default process group of one round."""

    device: torch.device

    def build(
        self,
        assignment: Assignment,
        timeout: timedelta,
        superseded: Callable[[], bool] = never,
        grow_heap_by: int = 0,
    ) -> None:
        """Create the round's store and default process group (every member calls it);
        :class:`RoundSuperseded` when ``superseded()`` turns true while the store is
        out of reach (``abort`` covers the waits after it connected). ``grow_heap_by``:
        in a process's first group, the most bytes its heap may grow by while it waits
        for the other members (waiting_heap.py; gloo only; 0: none)."""

    def abort(self) -> None:
        """Make collectives blocked in this group fail now; safe from any thread."""

    def adopt(self) -> contextlib.AbstractContextManager[None]:
        """A block that makes more groups of the round (a device mesh's): an abort
        reaches their collectives too."""

    def destroy(self) -> None:
        """Release the group (after ``abort`` or at the end of training)."""


def wait_for_listener(host: str, port: int, within: float) -> bool:
    """Does something accept connections at ``host:port`` within ``within`` seconds?"""
    until = time.monotonic() + within
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.01, min(1.0, within))).close()
            return True
        except OSError:
            if time.monotonic() >= until:
                return False
            time.sleep(LISTENER_POLL_S)


def round_store(
    assignment: Assignment,
    timeout: timedelta,
    superseded: Callable[[], bool],
    window: float = STORE_CONNECT_WINDOW_S,
) -> Store:
    """The round's TCPStore (rank 0 serves it, as torch's ``env://`` does) under the
    round's own key prefix, connected in ``window``-long tries (module docstring)."""
    host, port = assignment.master
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = deadline - time.monotonic()
        window_s = max(min(window, left), 0.001)
        try:
            if assignment.rank != 0 and not wait_for_listener(host, port, window_s):
                raise dist.DistNetworkError(f"nothing listens at {host}:{port} yet")
            store = TCPStore(
                host,
                port,
                assignment.world_size,
                is_master=assignment.rank == 0,
                timeout=timedelta(seconds=window_s),
                wait_for_workers=False,
                multi_tenant=True,
            )
            break
        except dist.DistNetworkError:
            if superseded():
                raise RoundSuperseded(
                    f"the round's store at {host}:{port} was out of reach, and a newer round "
                    "has replaced it"
                ) from None
            if time.monotonic() >= deadline:
                raise
    store.set_timeout(timeout)
    return PrefixStore(assignment.store_prefix(), store)


class Arrivals:
    """The round's members that have reached its store, counted there: each member adds
    itself once it connected, so one that waits can tell when the last has come."""

    def __init__(self, store: Store, assignment: Assignment) -> None:
        # the round's prefix names rank 0's endpoint, which a later round may reuse on a
        # store that lives on (multi-tenant): the round's id keeps the count its own
        self._key = f"arrived/{assignment.env.get(contract.ROUND_ID, '')}"
        self._counter = store
        self._world = assignment.world_size
        self._add(1)

    def _add(self, amount: int) -> int:
        """The count after adding ``amount``; the world's size when the store fails (no
        one waits on a broken store: the process group's build that follows reports it)."""
        try:
            return int(self._counter.add(self._key, amount))
        except Exception as exc:
            log.debug("the round's arrivals cannot be counted: %s", exc)
            return self._world

    def waiting(self) -> bool:
        """Is a member still missing?"""
        return self._add(0) < self._world


def grow_heap_while_waiting(arrivals: Arrivals, ceiling: int) -> Growth:
    """A first group's wait for its other members, used to grow the heap by up to
    ``ceiling`` bytes (waiting_heap.py); nothing when this member is the last to come."""
    heap = GlibcHeap.load() if ceiling and arrivals.waiting() else None
    if heap is None:
        return Growth(0, 0.0)
    grown = grow_while(arrivals.waiting, growth_limit(heap.size(), ceiling), heap)
    if grown.grown:
        log.info(
            "grew the heap by %d MiB in %.2f s while the group's other members came",
            grown.grown >> 20,
            grown.seconds,
        )
    return grown


class GlooRoundGroup:
    """gloo, aborted by shutting down the sockets it opened."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self._sockets: dict[int, int] = {}
        self._lock = threading.Lock()
        self.growth = Growth(0, 0.0)  # what the first group's wait grew (waiting_heap.py)

    def build(
        self,
        assignment: Assignment,
        timeout: timedelta,
        superseded: Callable[[], bool] = never,
        grow_heap_by: int = 0,
    ) -> None:
        before = open_sockets()
        store = round_store(assignment, timeout, superseded)
        with self._lock:  # an abort while gloo connects fails the store's waits
            self._sockets = opened_between(before, open_sockets())
        arrivals = Arrivals(store, assignment)
        if grow_heap_by:
            self.growth = grow_heap_while_waiting(arrivals, grow_heap_by)
        forget_failed_group_names()  # a failed build must not rename this one
        dist.init_process_group(
            "gloo",
            store=store,
            rank=assignment.rank,
            world_size=assignment.world_size,
            timeout=timeout,
        )
        with self._lock:
            self._sockets = opened_between(before, open_sockets())

    def abort(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, {}
        if sockets:
            log.info("abandoning the round's collectives (%d sockets shut)", shut_down(sockets))

    @contextlib.contextmanager
    def adopt(self) -> Iterator[None]:
        """The sockets the block opens join the ones an abort shuts: an HSDP mesh's
        replicate group, blocked on a dead peer, would otherwise wait for its timeout."""
        before = open_sockets()
        try:
            yield
        finally:
            with self._lock:
                self._sockets.update(opened_between(before, open_sockets()))

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class NcclRoundGroup:
    """NCCL, aborted by torch's own abort (untested here: no GPU)."""

    def __init__(self) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._lock = threading.Lock()
        self._live = False

    def build(
        self,
        assignment: Assignment,
        timeout: timedelta,
        superseded: Callable[[], bool] = never,
        grow_heap_by: int = 0,
    ) -> None:
        """``grow_heap_by`` is not used: a GPU worker's step lives in device memory."""
        forget_failed_group_names()  # as in GlooRoundGroup.build
        dist.init_process_group(
            "nccl",
            store=round_store(assignment, timeout, superseded),
            rank=assignment.rank,
            world_size=assignment.world_size,
            timeout=timeout,
        )
        with self._lock:
            self._live = True

    def adopt(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to record: torch's abort is called for the default group only, and
        whether it reaches a mesh's groups is untested here (no GPU)."""
        return contextlib.nullcontext()

    def abort(self) -> None:
        with self._lock:
            live, self._live = self._live, False
        if live and dist.is_initialized():
            abort_process_group()

    def destroy(self) -> None:
        with self._lock:
            self._live = False
        if dist.is_initialized():
            dist.destroy_process_group()


def round_group(backend: str) -> RoundGroup:
    """The :class:`RoundGroup` for ``backend`` ("gloo" or "nccl")."""
    if backend == "gloo":
        return GlooRoundGroup()
    if backend == "nccl":
        return NcclRoundGroup()
    raise ValueError(f"backend {backend!r} is not supported here; use 'gloo' or 'nccl'")
