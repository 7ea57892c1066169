"""Whether a job's checkpoints outlive its pods, said once on the job, pure.

The trainer checkpoints to ``ELASTICJOB_CHECKPOINT_DIR`` (``Run``'s default and the
examples' ``--checkpoint-dir`` default). Where that path is on the container's own
filesystem or on an ``emptyDir``, a checkpoint goes with its pod: a replacement still
gets the newest state from a surviving pod's memory, but when every pod goes at once (a
drained node pool, a preempted job) training starts over, and nothing said so. The job
gets one Warning, ``CheckpointsNotDurable``, when its worker Service is created, naming
the path, what holds it and the fix. A trainer that sets no such variable and mounts no
volume at all has nowhere durable to write; one that mounts a volume but sets no
variable may pass its own directory, so it gets no warning.
"""

from __future__ import annotations

from typing import Any, Final

from elasticjob_operator.decision import Event
from elasticjob_operator.models import PodSpec
from elasticjob_runtime import contract

REASON: Final = "CheckpointsNotDurable"
VARIABLE: Final = contract.CHECKPOINT_DIR
FIX: Final = (
    "mount a PersistentVolumeClaim there (ReadWriteMany when every worker must read every "
    "checkpoint, as for a sharded model)"
)


def checkpoint_path(spec: PodSpec) -> str | None:
    """The trainer's ``ELASTICJOB_CHECKPOINT_DIR`` as a literal value, else None."""
    for var in spec.containers[0].env or []:
        if var.name == VARIABLE:
            value = (var.model_extra or {}).get("value")
            return str(value) if value else None
    return None


def mount_holding(path: str, mounts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The volume mount whose mountPath is the deepest that contains ``path``."""
    parts = [p for p in path.split("/") if p]
    best: dict[str, Any] | None = None
    depth = -1
    for mount in mounts:
        at = [p for p in str(mount.get("mountPath", "")).split("/") if p]
        if parts[: len(at)] == at and len(at) > depth:
            best, depth = mount, len(at)
    return best


def not_durable(spec: PodSpec) -> str | None:
    """Why the trainer's checkpoints would go with its pod, or None when they need not."""
    trainer = spec.containers[0]
    mounts = trainer.volume_mounts or []
    path = checkpoint_path(spec)
    if path is None:
        if mounts:
            return None  # the script may pass its own directory on one of them
        return (
            f"the trainer sets no {VARIABLE} and mounts no volume: its checkpoints go to the "
            f"pod's own filesystem (/tmp) and are lost with it; set {VARIABLE} and {FIX}"
        )
    mount = mount_holding(path, mounts)
    if mount is None:
        return (
            f"{VARIABLE}={path} is on no volume, so on the container's own filesystem: "
            f"its checkpoints are lost with the pod; {FIX}"
        )
    volumes = {v.get("name"): v for v in spec.volumes or []}
    volume = volumes.get(mount.get("name"), {})
    if "emptyDir" in volume:
        return (
            f"{VARIABLE}={path} is on emptyDir volume {mount.get('name')!r}, which goes with "
            "its pod: a replacement gets the newest checkpoint from a surviving pod's memory, "
            f"but when every pod goes at once training starts over; {FIX}"
        )
    return None


def durability_warning(spec: PodSpec, reports: tuple[str, ...]) -> Event | None:
    """The Warning to post once ``reports`` (the worker Service) exists, if any."""
    why = not_durable(spec)
    return None if why is None else Event("Warning", REASON, why, reports)
