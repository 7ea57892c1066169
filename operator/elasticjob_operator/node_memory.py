"""The Warning a job gets when a checkpoint did not fit its workers' /dev/shm.

Pure: from the reports read in the run's etcd
(:class:`elasticjob_runtime.etcd.records.MemoryFallback`) to the event and
``status.nodeMemoryFallback``, with the ``shmSize`` that would fit. The rule ("Node memory")
is in docs/operator.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from elasticjob_operator import builders, models
from elasticjob_operator.decision import Event, warning
from elasticjob_operator.models import ElasticJobSpec
from elasticjob_runtime.etcd.records import MemoryFallback


def decide_memory_fallback(
    said: models.NodeMemoryFallback | None,
    run: str,
    reports: Sequence[MemoryFallback],
    spec: ElasticJobSpec,
    now: datetime,
) -> tuple[models.NodeMemoryFallback, Event] | None:
    """What to say about this run's reports: the first one (lowest step, then pod), once
    per run; None when there is nothing or it has been said."""
    if not reports or (said is not None and said.run_id == run):
        return None
    first = min(reports, key=lambda r: (r.step, r.pod))
    message = memory_fallback_message(first, spec)
    record = models.NodeMemoryFallback(
        run_id=run,
        pod=first.pod,
        step=first.step,
        checkpoint_bytes=first.checkpoint_bytes,
        shm_bytes=first.shm_bytes,
        message=message,
        time=now,
    )
    return record, warning("CheckpointNotInNodeMemory", message)


def _size(nbytes: int) -> str:
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    return f"{max(nbytes, 0) / 2**20:.0f} MiB"


def suggested_shm_size(checkpoint_bytes: int) -> str:
    """A /dev/shm limit for this checkpoint: two copies (the newest is written before the
    previous one goes) and a tenth for DataLoader batches, in whole GiB (or 256 MiB steps
    below 1 GiB)."""
    need = checkpoint_bytes * 2.2
    if need <= 2**30:
        return f"{max(1, -(-int(need) // 2**28)) * 256}Mi"
    return f"{-(-int(need) // 2**30)}Gi"


def memory_fallback_message(report: MemoryFallback, spec: ElasticJobSpec) -> str:
    """What the Warning event says: what happened, what it costs, and the fix."""
    shm = ""
    if report.shm_bytes is not None:
        shm = f" in a /dev/shm of {_size(report.shm_bytes)}"
        if report.free_bytes is not None:
            shm += f" ({_size(report.free_bytes)} free)"
    if not report.no_space:
        return (
            f"worker {report.pod}: the node-memory copy of checkpoint step {report.step} "
            f"failed ({report.error}); restarts on that node read the checkpoint directory"
        )
    size = suggested_shm_size(report.checkpoint_bytes)
    template = spec.worker.template.spec.model_dump(mode="json", by_alias=True)
    if template.get("hostIPC"):
        fix = f"free the host's /dev/shm (hostIPC) or make it at least {size}"
    elif builders.owns_shm(template):
        fix = f"give the /dev/shm the pod template mounts at least {size}"
    elif spec.shm_size_bytes == 0:
        fix = f"set spec.shmSize to at least {size} (0 keeps the runtime's 64 MiB /dev/shm)"
    else:
        fix = f"raise spec.shmSize ({spec.shm_size}) to at least {size}"
    return (
        f"worker {report.pod}: checkpoint step {report.step} ({_size(report.checkpoint_bytes)}) "
        f"does not fit{shm}, so restarts on that node read the checkpoint directory "
        f"instead of node memory: {fix}; pods created after the change get it"
    )
