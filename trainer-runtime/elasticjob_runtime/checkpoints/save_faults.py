"""A checkpoint copy that cannot be written: the save fails alone and training goes on.

The directory can develop faults while training runs (:data:`WRITE_FAULTS`): such a save
is said once per errno until one works again, and kept in one line
(:attr:`SaveFaults.save_error`, which ``Run`` publishes with the progress); the
last good checkpoint stays. The first node-memory copy that fails (most often a
``/dev/shm`` too small for it) is logged in one line and reported to the run's etcd
(:func:`elasticjob_runtime.etcd.progress.report_memory_fallback`), where the operator finds it
and says so once in the job's events, with the size that would fit; restarts then read
the directory. Torch-free: what is said depends only on the error and the filesystems.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from elasticjob_runtime import contract
from elasticjob_runtime.checkpoints.files import committed_steps, filesystem_space
from elasticjob_runtime.etcd.records import MemoryFallback

log = logging.getLogger(__name__)

# What a checkpoint filesystem can develop while training runs (full, remounted read-only,
# permissions changed, a failing disk): a save then fails, and training goes on.
WRITE_FAULTS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}
)


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


class SaveFaults:
    """The faults one manager's saves met, and who has been told.

    ``on_memory_fallback`` receives the node-memory report; None reports to the run's
    etcd (:func:`elasticjob_runtime.etcd.progress.memory_fallback_reporter_from_env`).
    """

    def __init__(self, on_memory_fallback: Callable[[MemoryFallback], None] | None) -> None:
        # The last save that could not be written to the directory (one line), None once
        # one is again.
        self.save_error: str | None = None
        self._said: set[int] = set()  # errnos logged since the last good save
        self._memory_failed = False
        self._on_memory_fallback = on_memory_fallback

    def disk_failed(self, directory: Path, step: int, exc: OSError) -> None:
        """A save the directory refused: one line per kind of fault until saves work again."""
        code = exc.errno if exc.errno is not None else -1
        try:
            kept = committed_steps(directory)
        except OSError:  # a failing disk may not list either
            kept = []
        self.save_error = write_fault_message(directory, step, exc, kept[-1:])
        if code not in self._said:
            self._said.add(code)
            log.error("%s", self.save_error)

    def disk_saved(self, directory: Path, step: int) -> None:
        """A save the directory took: if the last one failed, say that saves work again."""
        if self.save_error is not None:
            log.warning("checkpoint step %d saved in %s: saves work again", step, directory)
        self.save_error = None
        self._said.clear()

    def memory_failed(
        self, memory_dir: Path, directory: Path, step: int, size: int, exc: OSError
    ) -> None:
        """A failed node-memory copy: the first is logged and reported, later ones are not
        (a full ``/dev/shm`` stays full, and the disk copy stands)."""
        if self._memory_failed:
            return
        self._memory_failed = True
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
            directory,
            " On Kubernetes, raise the ElasticJob's spec.shmSize to twice the checkpoint."
            if no_space
            else "",
        )
        self._report(
            MemoryFallback(
                pod=os.environ.get(contract.POD_NAME) or socket.gethostname(),
                step=step,
                checkpoint_bytes=size,
                shm_bytes=total,
                free_bytes=free,
                no_space=no_space,
                error=str(exc),
                updated=time.time(),
            )
        )

    def _report(self, report: MemoryFallback) -> None:
        from elasticjob_runtime.etcd import progress  # torch-free, but loads the etcd client

        notify = self._on_memory_fallback or progress.memory_fallback_reporter_from_env()
        try:
            if notify is not None:
                notify(report)
        except Exception as report_exc:  # a report must never fail the save
            log.warning("node-memory fallback not reported: %s", report_exc)
