"""Checkpoints for elastic training scripts: atomic, verified, kept in node memory too.

A checkpoint is ``torch.save`` bytes written through :mod:`elasticjob_runtime.checkpoint_files`
(a data file plus a commit marker with its size and SHA-256, both durable before the
marker exists). ``load_latest`` walks the checkpoints from the newest and skips (logging
one line naming the file and the reason) any that has no marker, is truncated, fails its
checksum or cannot be loaded.

Node memory: the newest checkpoint is also written to a directory on ``/dev/shm`` keyed
by the job's identity (:mod:`elasticjob_runtime.job_identity`) and pod, made 0700; a
node-memory checkpoint that another job wrote is skipped. tmpfs is RAM, it outlives the
worker process (the agent and the pod keep it) and it needs no server, so a worker
restarted by the agent reloads without touching the (maybe network) disk;
``load_latest`` prefers the memory copy when it is at least as new. A server inside the
agent would work as well but adds a protocol and a process to keep alive for no gain. A
container runtime's own ``/dev/shm`` is 64 MiB, too small for a real model, so the
operator gives worker pods a memory-backed one of ``spec.shmSize`` (default 2Gi; the
newest copy is written before the previous one goes, so it needs twice the checkpoint).
When the memory copy does not fit (or fails otherwise) the disk copy still stands; the
first failure is logged in one line and reported to the run's etcd
(:func:`elasticjob_runtime.progress.report_memory_fallback`), where the operator finds
it and says so once in the job's events, with the size that would fit.

Typical use in a DDP script::

    ckpt = CheckpointManager("/ckpt", keep=3, async_save=True)
    ckpt.install_sigterm_handler()
    state = {"model": ddp_model, "optim": optimizer, "sampler": sampler}
    ckpt.track(state)
    resumed = ckpt.restore(state)            # None on a fresh start
    step = resumed.step if resumed else 0
    while ...:
        ...one optimizer step...
        step += 1
        ckpt.mark_step(step)                 # saves and exits here after SIGTERM
        if step % 100 == 0:
            ckpt.save(state, step)
    ckpt.close()

Values with a ``state_dict()`` (modules, optimizers, samplers, schedulers) are
saved through it, DDP/DataParallel wrappers are unwrapped to ``.module`` so the
checkpoint loads into an unwrapped model too; anything else must be picklable.

Loading is data only (``torch.load(weights_only=True)``, bytes from peers too): a
checkpoint that needs more raises :class:`UnsafeCheckpointError` unless its classes are
registered with ``torch.serialization.add_safe_globals`` or the caller passes
``weights_only=False``. A save the directory refuses (full, read-only: :data:`WRITE_FAULTS`)
fails alone, said once per errno and kept in :attr:`CheckpointManager.save_error`; the last
good checkpoint stays. docs/checkpoints.md has the whole story.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import io
import logging
import os
import pickle
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elasticjob_runtime import contract
from elasticjob_runtime.channel import StepReporter
from elasticjob_runtime.checkpoint_files import (
    checkpoint_name,
    commit,
    committed_steps,
    default_memory_dir,
    filesystem_space,
    prune,
    read_verified,
    steps_on_disk,
)
from elasticjob_runtime.job_identity import current_job
from elasticjob_runtime.records import MemoryFallback
from elasticjob_runtime.sigterm_save import SigtermSave
from elasticjob_runtime.snapshot import Snapshots

log = logging.getLogger(__name__)

# What a checkpoint filesystem can develop while training runs (full, remounted read-only,
# permissions changed, a failing disk): a save then fails, and training goes on.
WRITE_FAULTS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}
)

StateSource = Mapping[str, Any] | Callable[[], Mapping[str, Any]]


class CheckpointError(RuntimeError):
    """A save or restore that cannot go on; the message says what to fix."""


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: its step, the saved mapping and where it came from."""

    step: int
    state: dict[str, Any]
    path: Path


# ---------------------------------------------------------------- pure helpers


def unwrap(obj: Any) -> Any:
    """The module inside a DDP/DataParallel wrapper, else ``obj`` itself."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    return obj.module if isinstance(obj, wrappers) else obj


def state_to_save(state: Mapping[str, Any]) -> dict[str, Any]:
    """Turn live objects into what is saved: ``state_dict()`` where there is one."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        inner = unwrap(value)
        method = getattr(inner, "state_dict", None)
        out[key] = method() if callable(method) else value
    return out


def serialize(state: Mapping[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    return buf.getvalue()


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint that only full unpickling (which can run any code) would load."""


def deserialize(
    data: bytes, weights_only: bool = True, map_location: str = "cpu", source: str = "bytes"
) -> dict[str, Any]:
    """``torch.load`` the bytes, with torch's safe loader unless ``weights_only=False``.

    The safe loader builds tensors, containers and primitives and calls no other code;
    a checkpoint that needs more raises :class:`UnsafeCheckpointError` naming ``source``,
    what it needs and how to allow it.
    """
    try:
        loaded = torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        if not weights_only:
            raise
        raise UnsafeCheckpointError(unsafe_message(source, str(exc))) from None
    if not isinstance(loaded, dict):
        raise CheckpointError(f"checkpoint holds a {type(loaded).__name__}, expected a dict")
    return loaded


def unsafe_message(source: str, error: str) -> str:
    """One line: what the safe loader refused in ``source`` and the two ways to allow it."""
    found = re.search(r"GLOBAL (\S+) was not an allowed global", error)
    need = f"needs {found.group(1)}" if found else f"is not plain data ({error.splitlines()[0]})"
    return (
        f"checkpoint {source} {need}, which the safe loader refuses (loading it could run "
        "any code); register a class you trust with torch.serialization.add_safe_globals, "
        "or pass weights_only=False to restore()/load_latest() if you trust every "
        "checkpoint this job reads (its directory, node memory and peers)"
    )


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

    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    if dist.get_rank() == src:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src)
    if dist.get_rank() == src:
        return data
    host = buf.cpu().contiguous()
    return ctypes.string_at(host.data_ptr(), host.numel())


def write_fault_message(directory: Path, step: int, exc: OSError, newest: list[int]) -> str:
    """One line: which save failed where, the errno, and what stands instead."""
    name = errno.errorcode.get(exc.errno or -1, str(exc.errno))
    stands = (
        f"step {newest[0]}, the newest checkpoint there, stands"
        if newest
        else "nothing was saved there before"
    )
    return (
        f"checkpoint step {step} not saved in {directory}: {name} "
        f"({exc.strerror or exc}); {stands} and training goes on"
    )


def _mib(nbytes: int | None) -> str:
    return "?" if nbytes is None else f"{nbytes / 2**20:.0f} MiB"


def _env_rank(name: str) -> int:
    return int(os.environ.get(name, "0"))


# ---------------------------------------------------------------- the manager


class CheckpointManager:
    """Saves and restores a training script's state (see the module docstring).

    ``writer`` (default: global rank 0, or local rank 0 when ``node_local``) writes
    to ``directory``; ``memory_writer`` (default: local rank 0) writes the node
    memory copy. Every rank may call ``save``; the others only count the step.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        keep: int = 3,
        async_save: bool = False,
        node_local: bool = False,
        memory: bool = True,
        memory_dir: str | os.PathLike[str] | None = None,
        writer: bool | None = None,
        memory_writer: bool | None = None,
        run_id: str | None = None,
        on_memory_fallback: Callable[[MemoryFallback], None] | None = None,
        job: str | None = None,
    ) -> None:
        where = directory if directory is not None else os.environ.get(contract.CHECKPOINT_DIR)
        if not where:
            raise CheckpointError(
                f"no checkpoint directory: pass one or set {contract.CHECKPOINT_DIR}"
            )
        if keep < 1:
            raise CheckpointError(f"keep must be >= 1 (got {keep})")
        self.directory = Path(where)
        self.keep = keep
        self.async_save = async_save
        # who wrote a checkpoint: node memory holds only this job's (job_identity.py)
        self.job = job or current_job(run_id)
        self.memory_dir: Path | None = None
        self._memory_shared: Path | None = None  # /dev/shm/elasticjob: every job's, 1777
        if memory:
            self.memory_dir = Path(memory_dir) if memory_dir else default_memory_dir(self.job)
            if not memory_dir and self.memory_dir is not None:
                self._memory_shared = self.memory_dir.parent.parent
        local_rank = _env_rank("LOCAL_RANK")
        if writer is None:
            writer = local_rank == 0 if node_local else _env_rank("RANK") == 0
        self.writer = writer
        self.memory_writer = local_rank == 0 if memory_writer is None else memory_writer
        self._pending: threading.Thread | None = None
        self._snapshots = Snapshots()  # an async save's CPU copy, reused by the next one
        self._pending_step = -1
        self._error: BaseException | None = None
        self._memory_warned = False
        # The last save that could not be written to ``directory`` (one line), None once
        # one is again; elastic.Run publishes it with the progress (status.progress).
        self.save_error: str | None = None
        self._faults_said: set[int] = set()  # errnos logged since the last good save
        # None: report to the run's etcd (progress.memory_fallback_reporter_from_env)
        self._on_memory_fallback = on_memory_fallback
        self._tracked: StateSource | None = None
        self._step: int | None = None
        # Under elasticjob-run, each marked step also tells the agent (its hang clock).
        self._step_reporter = StepReporter.from_env()
        self._saved_step: int | None = None
        self._sigterm = SigtermSave(self._save_last_step, lambda: self._step)

    @property
    def saved_step(self) -> int | None:
        """The newest step restored, or saved wherever this rank writes with no fault."""
        return self._saved_step

    @property
    def pending_step(self) -> int | None:
        """The step of the asynchronous save not yet waited for (in flight or done)."""
        return self._pending_step if self._pending is not None else None

    # -- saving

    def save(self, state: Mapping[str, Any], step: int, *, blocking: bool | None = None) -> None:
        """Save ``state`` as ``step``; asynchronous unless ``blocking`` (or the manager's default).

        An asynchronous save first copies every tensor to CPU, so the caller may
        change the model at once; that copy is all it waits for (serialising, hashing and
        writing run in a thread). The copy goes into the previous async save's CPU
        buffers, kept between saves (:mod:`elasticjob_runtime.snapshot`). One save is in
        flight at a time: this call waits for the previous one and raises its error, if
        it had one.
        """
        self.wait()
        checkpoint_name(step)  # validates the step
        self._step = step if self._step is None else max(self._step, step)
        if self._tracked is None:
            self._tracked = state
        if not (self.writer or self.memory_writer):
            self._saved_step = step
            return
        run_async = self.async_save if blocking is None else not blocking
        saved = state_to_save(state)
        if not run_async:
            try:
                self._write(saved, step, self.writer)
            except OSError as exc:
                raise CheckpointError(
                    f"saving checkpoint step {step} to {self.directory} failed: {exc}"
                ) from exc
            return
        snap = self._snapshots.take(saved)
        self._pending_step = step
        self._pending = threading.Thread(
            target=self._write_catching, args=(snap, step), name=f"checkpoint-{step}", daemon=True
        )
        self._pending.start()

    def _write_catching(self, state: dict[str, Any], step: int) -> None:
        try:
            self._write(state, step, self.writer)
        except BaseException as exc:
            self._error = exc

    def _write(self, state: Mapping[str, Any], step: int, to_disk: bool) -> None:
        """Write ``step`` to the directory (if ``to_disk``) and to node memory.

        A write fault (:data:`WRITE_FAULTS`) fails this save alone: it is logged,
        recorded in :attr:`save_error`, and what was saved before stays; other errors
        (a file where the directory should be) raise.
        """
        data = serialize(state)
        to_memory = self.memory_writer and self.memory_dir is not None
        # hashed once for both copies (a GB takes seconds)
        digest = hashlib.sha256(data).hexdigest() if to_disk or to_memory else None
        saved = False
        if to_disk:
            try:
                commit(self.directory, step, data, job=self.job, digest=digest)
            except OSError as exc:
                if exc.errno not in WRITE_FAULTS:
                    raise
                self._disk_failed(step, exc)
            else:
                saved = True
                self._disk_saved(step)
                try:
                    prune(self.directory, self.keep, protect=step)
                except OSError as exc:
                    if exc.errno not in WRITE_FAULTS:
                        raise
                    log.warning("old checkpoints in %s not removed: %s", self.directory, exc)
        if to_memory and self.memory_dir is not None:
            try:
                commit(
                    self.memory_dir,
                    step,
                    data,
                    job=self.job,
                    private=True,
                    shared=self._memory_shared,
                    digest=digest,
                )
                prune(self.memory_dir, 1, protect=step)
                saved = True
            except OSError as exc:
                if not self._memory_warned:
                    self._memory_warned = True
                    self._memory_failed(self.memory_dir, step, len(data), exc)
        # saved where this rank writes; a directory fault leaves the step to be saved again
        if (saved and self.save_error is None) or not (to_disk or to_memory):
            self._saved_step = step

    def _disk_failed(self, step: int, exc: OSError) -> None:
        """A save the directory refused: one line per kind of fault until saves work again."""
        code = exc.errno if exc.errno is not None else -1
        try:
            kept = committed_steps(self.directory)
        except OSError:  # a failing disk may not list either
            kept = []
        self.save_error = write_fault_message(self.directory, step, exc, kept[-1:])
        if code not in self._faults_said:
            self._faults_said.add(code)
            log.error("%s", self.save_error)

    def _disk_saved(self, step: int) -> None:
        if self.save_error is not None:
            log.warning("checkpoint step %d saved in %s: saves work again", step, self.directory)
        self.save_error = None
        self._faults_said.clear()

    def _memory_failed(self, memory_dir: Path, step: int, size: int, exc: OSError) -> None:
        """The first failed node-memory copy: one log line, and a report to the operator."""
        from elasticjob_runtime import progress  # torch-free, but loads the etcd client

        total, free = filesystem_space(memory_dir)
        no_space = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        log.warning(
            "node-memory checkpoint copy in %s failed (%s): step %d is %s, on a filesystem "
            "of %s (%s free); restarts will read %s.%s",
            memory_dir,
            exc,
            step,
            _mib(size),
            _mib(total),
            _mib(free),
            self.directory,
            " On Kubernetes, raise the ElasticJob's spec.shmSize to twice the checkpoint."
            if no_space
            else "",
        )
        report = MemoryFallback(
            pod=os.environ.get(contract.POD_NAME) or socket.gethostname(),
            step=step,
            checkpoint_bytes=size,
            shm_bytes=total,
            free_bytes=free,
            no_space=no_space,
            error=str(exc),
            updated=time.time(),
        )
        notify = self._on_memory_fallback or progress.memory_fallback_reporter_from_env()
        try:
            if notify is not None:
                notify(report)
        except Exception as report_exc:  # a report must never fail the save
            log.warning("node-memory fallback not reported: %s", report_exc)

    def wait(self) -> None:
        """Wait for an asynchronous save in flight; raise :class:`CheckpointError` if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.join()
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(
                f"saving checkpoint step {self._pending_step} to {self.directory} failed: {error}"
            ) from error

    def close(self) -> None:
        """Finish the save in flight (raising its error), free the async saves' CPU
        buffers and put back the SIGTERM handler."""
        try:
            self.wait()
        finally:
            self._snapshots.release()
            self._sigterm.uninstall()

    # -- loading

    def _sources(self) -> list[Path]:
        return [d for d in (self.memory_dir, self.directory) if d is not None]

    def load_latest(
        self, *, weights_only: bool = True, map_location: str = "cpu"
    ) -> Checkpoint | None:
        """The newest intact checkpoint (node memory first at equal step), or None.

        Each checkpoint passed over is logged in one line with the reason; one in node
        memory that another job wrote is passed over too. The directory is the one you
        named, so any job's checkpoint there is loaded (that is how a re-created job
        resumes). ``weights_only=False`` unpickles without the safe loader: only for
        checkpoints you trust, since unpickling can run any code. One that needs it
        otherwise raises :class:`UnsafeCheckpointError` rather than be passed over (a
        fresh start would silently drop the training done).
        """
        self.wait()
        by_step: dict[int, list[Path]] = {}
        for source in self._sources():
            for step in steps_on_disk(source):
                by_step.setdefault(step, []).append(source)
        for step in sorted(by_step, reverse=True):
            for source in by_step[step]:
                path = source / checkpoint_name(step)
                job = self.job if source == self.memory_dir else None
                data, reason = read_verified(source, step, job)
                if data is None:
                    log.warning("skipping checkpoint %s: %s", path, reason)
                    continue
                try:
                    state = deserialize(data, weights_only, map_location, str(path))
                except UnsafeCheckpointError:
                    raise
                except Exception as exc:
                    log.warning("skipping checkpoint %s: cannot be loaded (%s)", path, exc)
                    continue
                return Checkpoint(step, state, path)
        return None

    def restore(
        self, targets: Mapping[str, Any], *, weights_only: bool = True, sync: bool = True
    ) -> Checkpoint | None:
        """Load the newest checkpoint into ``targets`` (by key, via ``load_state_dict``).

        Targets without ``load_state_dict`` are left alone; read them from the
        returned checkpoint's ``state``. Returns None (and changes nothing) when
        there is no checkpoint yet.

        With ``sync`` and an initialized process group, every rank must call it:
        the ranks agree on the newest step any of them has, and ranks without it
        (a node that joined with an empty node-local directory) receive it over
        the process group from the lowest rank that has it; their writers commit
        it locally. So all ranks always resume from the same step. Bytes from a peer
        are loaded as ``weights_only`` says, like files (see :meth:`load_latest`).
        """
        ckpt = self.load_latest(weights_only=weights_only)
        if sync:
            ckpt = self._agree(ckpt, weights_only)
        if ckpt is None:
            return None
        for key, target in targets.items():
            inner = unwrap(target)
            loader = getattr(inner, "load_state_dict", None)
            if not callable(loader):
                continue
            if key not in ckpt.state:
                raise CheckpointError(
                    f"checkpoint {ckpt.path} has no {key!r} entry (it has "
                    f"{sorted(ckpt.state)}); save that key or drop it from the restore"
                )
            loader(ckpt.state[key])
        self._step = self._saved_step = ckpt.step
        return ckpt

    def _agree(self, ckpt: Checkpoint | None, weights_only: bool = True) -> Checkpoint | None:
        """Make every rank hold the newest step any rank has."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return ckpt
        rank = dist.get_rank()
        device = group_device()
        steps = gather_steps(-1 if ckpt is None else ckpt.step, device)
        newest = max(steps)
        if newest < 0 or all(s == newest for s in steps):
            return ckpt
        src = steps.index(newest)
        data = serialize(ckpt.state) if rank == src and ckpt is not None else b""
        received = broadcast_bytes(data, src, device)
        if ckpt is not None and ckpt.step == newest:
            return ckpt
        state = deserialize(received, weights_only, source=f"step {newest} from rank {src}")
        log.warning(
            "checkpoint step %d received from rank %d (this rank had %s)",
            newest,
            src,
            "none" if ckpt is None else f"step {ckpt.step}",
        )
        path = Path(f"<rank {src}>") / checkpoint_name(newest)
        if self.writer or self.memory_writer:
            self._write(state, newest, self.writer)
            if self.writer:
                path = self.directory / checkpoint_name(newest)
        return Checkpoint(newest, state, path)

    # -- SIGTERM

    def track(self, state: StateSource) -> None:
        """Register the live state (or a function returning it) to save on SIGTERM."""
        self._tracked = state

    @property
    def stop_requested(self) -> bool:
        """True once SIGTERM arrived (the next ``mark_step`` saves and exits)."""
        return self._sigterm.requested

    def mark_step(self, step: int) -> None:
        """Record that ``step`` is complete; after SIGTERM, save it and exit here.

        Call it between optimizer steps, where model, optimizer and sampler agree. Under
        ``elasticjob-run`` it is also the step the agent's hang detection watches.
        """
        self._step = step
        if self._step_reporter is not None:
            self._step_reporter.report(step)
        self._sigterm.at_step_boundary()

    def install_sigterm_handler(self, grace_s: float = 20.0) -> None:
        """On SIGTERM, save the tracked state at the next ``mark_step`` and exit 143
        (:mod:`elasticjob_runtime.sigterm_save`: or from a watchdog after ``grace_s``,
        or at exit). Keep ``grace_s`` below the pod's terminationGracePeriodSeconds and
        the agent's SIGKILL delay (30 s in torch)."""
        self._sigterm.install(grace_s)

    def _save_last_step(self) -> None:
        """The last marked step, as tracked, unless it is saved already."""
        started = time.monotonic()
        with contextlib.suppress(CheckpointError):
            self.wait()  # an async save in flight may be the step we want
        step, tracked = self._step, self._tracked
        if step is None or tracked is None:
            log.warning("SIGTERM: nothing to save (no step marked or no state tracked)")
            return
        if self._saved_step == step:
            log.warning("SIGTERM: step %d is already saved", step)
            return
        live = tracked() if callable(tracked) else tracked
        # local rank 0 writes the disk copy too: the writer may be on a node not terminating
        to_disk = self.writer or self.memory_writer
        if to_disk or self.memory_writer:
            self._write(state_to_save(live), step, to_disk)
            log.warning("SIGTERM: saved step %d in %.2f s", step, time.monotonic() - started)
