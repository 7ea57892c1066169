"""Names a script keeps across rounds for objects that each round builds anew.

A sharded model is bound to its round's mesh, so every regroup builds the model, its
optimizer and its schedulers again (fsdp_replication.py). The script's loop keeps the
names ``run.shard`` returned; each is a :class:`Current` that stands for the object of
the round in force, the way :class:`~elasticjob_runtime.training.current_ddp.CurrentDDP`
stands for the round's DDP: calls and attributes go to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


class Current:
    """The round's object behind a name that outlives the round."""

    def __init__(self, get: Callable[[], Any], what: str) -> None:
        object.__setattr__(self, "_get", get)
        object.__setattr__(self, "_what", what)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._get()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._get(), name, value)

    def __repr__(self) -> str:
        return f"<the current round's {self._what}: {self._get()!r}>"


class Sharded(NamedTuple):
    """What ``run.shard`` returns: ``model, optimizer, state = run.shard(build, sampler)``."""

    model: Any
    optimizer: Any
    state: dict[str, Any]
