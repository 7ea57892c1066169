"""Reading a checkpoint back: the newest intact one, agreed over the group, into live objects.

:func:`newest_intact` walks the checkpoints from the newest and skips (logging one line
naming the file and the reason) any that has no commit marker, is truncated, fails its
checksum or cannot be loaded, and one in node memory that another job wrote; at equal
step the node-memory copy comes first (it needs no (maybe network) disk). One that only
full unpickling would load raises instead of being skipped: a fresh start would silently
drop the training done. :func:`newest_of_group` then makes every rank hold the newest
step any rank has, so all ranks resume from the same step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from elasticjob_runtime.checkpoints.files import checkpoint_name, read_verified, steps_on_disk
from elasticjob_runtime.checkpoints.format import (
    Checkpoint,
    CheckpointError,
    UnsafeCheckpointError,
    deserialize,
    serialize,
    unwrap,
)
from elasticjob_runtime.checkpoints.state_transfer import (
    broadcast_bytes,
    gather_steps,
    group_device,
)

log = logging.getLogger(__name__)


def reading_order(steps_by_source: Iterable[tuple[Path, Iterable[int]]]) -> list[tuple[int, Path]]:
    """Which checkpoints to try, as (step, source): newest step first, and at equal step
    in the order the sources came (node memory before the directory)."""
    by_step: dict[int, list[Path]] = {}
    for source, steps in steps_by_source:
        for step in steps:
            by_step.setdefault(step, []).append(source)
    return [(step, source) for step in sorted(by_step, reverse=True) for source in by_step[step]]


def newest_intact(
    directory: Path,
    memory_dir: Path | None,
    job: str,
    *,
    weights_only: bool = True,
    map_location: str = "cpu",
) -> Checkpoint | None:
    """The newest checkpoint in node memory or ``directory`` that reads back whole, or None.

    Only node memory is checked for ``job``: the directory is the one the user named, so
    any job's checkpoint there is loaded (that is how a re-created job resumes).
    """
    sources = [d for d in (memory_dir, directory) if d is not None]
    for step, source in reading_order([(s, steps_on_disk(s)) for s in sources]):
        path = source / checkpoint_name(step)
        data, reason = read_verified(source, step, job if source == memory_dir else None)
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


def load_into(targets: Mapping[str, Any], ckpt: Checkpoint) -> None:
    """Each target with ``load_state_dict`` loads its entry; the others are left alone."""
    for key, target in targets.items():
        loader = getattr(unwrap(target), "load_state_dict", None)
        if not callable(loader):
            continue
        if key not in ckpt.state:
            raise CheckpointError(
                f"checkpoint {ckpt.path} has no {key!r} entry (it has "
                f"{sorted(ckpt.state)}): it was saved before {key!r} was (an object "
                "added to state= since?); start from a new checkpoint directory, or drop "
                f"{key!r} from what is restored"
            )
        loader(ckpt.state[key])


def source_rank(steps: Sequence[int]) -> int | None:
    """The lowest rank holding the newest of every rank's step (-1 for none), or None
    when there is nothing to send: every rank holds that step, or none holds any."""
    newest = max(steps)
    if newest < 0 or all(s == newest for s in steps):
        return None
    return steps.index(newest)


def newest_of_group(ckpt: Checkpoint | None, weights_only: bool = True) -> Checkpoint | None:
    """The newest checkpoint any rank of the default group holds; every rank must call it.

    This rank's own ``ckpt`` comes back as it is when no rank holds a newer step;
    otherwise the newest arrives from the lowest rank holding it (loaded as
    ``weights_only`` says, like files), its path naming that rank.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return ckpt
    device = group_device()
    steps = gather_steps(-1 if ckpt is None else ckpt.step, device)
    src = source_rank(steps)
    if src is None:
        return ckpt
    newest = steps[src]
    data = serialize(ckpt.state) if dist.get_rank() == src and ckpt is not None else b""
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
    return Checkpoint(newest, state, Path(f"<rank {src}>") / checkpoint_name(newest))
