"""Checkpoints for elastic training scripts: atomic, verified, kept in node memory too.

A checkpoint is ``torch.save`` bytes (:mod:`elasticjob_runtime.checkpoints.format`)
written through :mod:`elasticjob_runtime.checkpoints.files` (a data file plus a commit
marker with its size and SHA-256, both durable before the marker exists). Reading back
(:mod:`elasticjob_runtime.checkpoints.restore`) takes the newest intact one and skips,
in one logged line each, those that are not.

Node memory: the newest checkpoint is also written to a directory on ``/dev/shm`` keyed
by the job's identity (:mod:`elasticjob_runtime.checkpoints.job_identity`) and pod, made 0700; a
node-memory checkpoint that another job wrote is skipped. tmpfs is RAM, it outlives the
worker process (the agent and the pod keep it) and it needs no server, so a worker
restarted by the agent reloads without touching the (maybe network) disk;
``load_latest`` prefers the memory copy when it is at least as new. A server inside the
agent would work as well but adds a protocol and a process to keep alive for no gain. A
container runtime's own ``/dev/shm`` is 64 MiB, too small for a real model, so the
operator gives worker pods a memory-backed one of ``spec.shmSize`` (default 2Gi; the
newest copy is written before the previous one goes, so it needs twice the checkpoint).
When the memory copy does not fit (or fails otherwise) the disk copy still stands
(:mod:`elasticjob_runtime.checkpoints.save_faults` says so, to the log and the operator).

Typical use in a DDP script::

    ckpt = CheckpointManager("/ckpt", keep=3, async_save=True)
    ckpt.install_sigterm_handler()
    ckpt.guard_updates(optimizer)            # a SIGTERM save never catches it mid-update
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

Loading is data only, bytes from peers too
(:class:`~elasticjob_runtime.checkpoints.format.UnsafeCheckpointError` says how to allow
more). A save the directory refuses (full, read-only:
:data:`~elasticjob_runtime.checkpoints.save_faults.WRITE_FAULTS`) fails alone, said once per errno
and kept in :attr:`CheckpointManager.save_error`; the last good checkpoint stays.
docs/checkpoints.md has the whole story.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elasticjob_runtime import contract
from elasticjob_runtime.checkpoints.files import (
    Written,
    checkpoint_name,
    commit,
    default_memory_dir,
    prune,
)
from elasticjob_runtime.checkpoints.format import (
    Checkpoint,
    CheckpointError,
    serialize_into,
    state_to_save,
)
from elasticjob_runtime.checkpoints.job_identity import current_job
from elasticjob_runtime.checkpoints.restore import load_into, newest_intact, newest_of_group
from elasticjob_runtime.checkpoints.save_faults import WRITE_FAULTS, SaveFaults
from elasticjob_runtime.checkpoints.sigterm_save import SigtermSave
from elasticjob_runtime.checkpoints.snapshot import Snapshots
from elasticjob_runtime.checkpoints.state_broadcast import map_tensors
from elasticjob_runtime.etcd.records import MemoryFallback
from elasticjob_runtime.launch.channel import StepReporter

if TYPE_CHECKING:
    from torch.optim import Optimizer

log = logging.getLogger(__name__)

StateSource = Mapping[str, Any] | Callable[[], Mapping[str, Any]]


def _env_rank(name: str) -> int:
    return int(os.environ.get(name, "0"))


def _tensor_bytes(state: Mapping[str, Any]) -> int:
    """About a checkpoint's size, its tensors' bytes: for a copy that failed before
    any copy of it was written."""
    sizes: list[int] = []
    map_tensors(state, lambda t: sizes.append(t.numel() * t.element_size()))
    return sum(sizes)


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
        self._faults = SaveFaults(on_memory_fallback)
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
    def save_error(self) -> str | None:
        """The last save that could not be written to ``directory`` (one line), None once
        one is again; the Run publishes it with the progress (status.progress)."""
        return self._faults.save_error

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
        buffers, kept between saves (:mod:`elasticjob_runtime.checkpoints.snapshot`). One save is in
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
        to_memory = self.memory_writer and self.memory_dir is not None
        fill = functools.partial(serialize_into, state)
        first: Written | None = None  # the copy the other one is copied from, unread
        saved = False
        if to_disk:
            try:
                first = commit(self.directory, step, fill, job=self.job)
            except OSError as exc:
                if exc.errno not in WRITE_FAULTS:
                    raise
                self._faults.disk_failed(self.directory, step, exc)
            else:
                saved = True
                self._faults.disk_saved(self.directory, step)
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
                    first or fill,
                    job=self.job,
                    private=True,
                    shared=self._memory_shared,
                )
                prune(self.memory_dir, 1, protect=step)
                saved = True
            except OSError as exc:
                size = first.size if first else _tensor_bytes(state)
                self._faults.memory_failed(self.memory_dir, self.directory, step, size, exc)
        # saved where this rank writes; a directory fault leaves the step to be saved again
        if (saved and self.save_error is None) or not (to_disk or to_memory):
            self._saved_step = step

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
        return newest_intact(
            self.directory,
            self.memory_dir,
            self.job,
            weights_only=weights_only,
            map_location=map_location,
        )

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
        load_into(targets, ckpt)
        self._step = self._saved_step = ckpt.step
        return ckpt

    def _agree(self, ckpt: Checkpoint | None, weights_only: bool = True) -> Checkpoint | None:
        """Make every rank hold the newest step any rank has; one received from a peer
        (not ``ckpt``) is written where this rank writes, so a restart finds it here."""
        agreed = newest_of_group(ckpt, weights_only)
        if agreed is None or agreed is ckpt or not (self.writer or self.memory_writer):
            return agreed
        self._write(agreed.state, agreed.step, self.writer)
        if not self.writer:
            return agreed
        return replace(agreed, path=self.directory / checkpoint_name(agreed.step))

    # -- SIGTERM

    def track(self, state: StateSource) -> None:
        """Register the live state (or a function returning it) to save on SIGTERM."""
        self._tracked = state

    def untrack(self) -> None:
        """Save nothing on SIGTERM: the state is not one rank's to write (sharded state
        is saved by every rank together, checkpoints/sharded.py)."""
        self._tracked = None

    @property
    def stop_requested(self) -> bool:
        """True once SIGTERM arrived (the next ``mark_step`` saves and exits)."""
        return self._sigterm.requested

    def mark_step(self, step: int, *, stop_here: bool = True) -> None:
        """Record that ``step`` is complete; after SIGTERM, save it and exit here (unless
        not ``stop_here``: the caller stops at a later boundary, as ranks that save
        together do once they agree on one).

        Call it between optimizer steps, where model, optimizer and sampler agree. Under
        ``elasticjob-run`` it is also the step the agent's hang detection watches.
        """
        self._step = step
        if self._step_reporter is not None:
            self._step_reporter.report(step)
        self._sigterm.at_step_boundary(stop_here)

    def saved_elsewhere(self, step: int) -> None:
        """``step`` is saved, though not by this manager (a sharded checkpoint): a
        SIGTERM at this step has nothing left to save."""
        self._saved_step = step

    def install_sigterm_handler(self, grace_s: float = 20.0) -> None:
        """On SIGTERM, save the tracked state at the next ``mark_step`` and exit 143
        (:mod:`elasticjob_runtime.checkpoints.sigterm_save`: or from a watchdog after ``grace_s``,
        or at exit). Keep ``grace_s`` below the pod's terminationGracePeriodSeconds and
        the agent's SIGKILL delay (30 s in torch)."""
        self._sigterm.install(grace_s)

    def guard_updates(self, optimizer: Optimizer) -> None:
        """Let the SIGTERM saves off the step boundary see ``optimizer`` begin an update (a
        step pre-hook), so none records a state changed past the marked step (sigterm_save.py).
        ``Run`` guards its optimizers; unguarded, those saves assume no update comes."""
        optimizer.register_step_pre_hook(self._sigterm.guard.before_update)

    def _save_last_step(self) -> None:
        """The last marked step, as tracked, unless it is saved already."""
        started = time.monotonic()
        with contextlib.suppress(CheckpointError):
            self.wait()  # an async save in flight may be the step we want
        step, tracked = self._step, self._tracked
        if step is not None and self._saved_step == step:
            log.warning("SIGTERM: step %d is already saved", step)
            return
        if step is None or tracked is None:
            log.warning("SIGTERM: nothing to save (no step marked or no state tracked)")
            return
        live = tracked() if callable(tracked) else tracked
        # local rank 0 writes the disk copy too: the writer may be on a node not terminating
        to_disk = self.writer or self.memory_writer
        if to_disk or self.memory_writer:
            self._write(state_to_save(live), step, to_disk)
            log.warning("SIGTERM: saved step %d in %.2f s", step, time.monotonic() - started)
