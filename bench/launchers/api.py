"""What the bench needs of a launcher: how it starts a node, what it runs, where its nodes meet.

A peer we race (torchrun, torchft, ...) is one module of this package implementing
:class:`Launcher`; the faults themselves (kill a worker, kill or freeze a node, stop one
politely, add one) are the same process-level acts for every launcher and live on
:class:`bench.harness.Agent`, and every script the bench runs prints the same
``step= ... world= ... pid= t=`` line, so one parser reads every launcher's step log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from bench.harness import Job


class Workload(StrEnum):
    """A training script the bench runs, each written once per launcher family."""

    REGRESSION = "regression"  # examples/train_regression.py: the small DDP model
    GPT = "gpt"  # the realistic DDP script (bench.real_scripts)
    GPT_FSDP = "gpt-fsdp"  # the realistic FSDP2 script (bench.sharded)
    CLASSIC = "classic"  # an unchanged torchelastic script (bench.classic)


@dataclass(frozen=True)
class NodeCommand:
    """One node's process: its command line and what it adds to the job's environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


class Launcher(Protocol):
    """One way to run a job's nodes (one process per node; its workers below it)."""

    @property
    def name(self) -> str:
        """As ``--launchers`` and the results name it."""
        ...

    def script(self, workload: Workload) -> Path | None:
        """The script written for this launcher, or None where none is (the bench then
        skips that workload for it and says so)."""
        ...

    def endpoint(self, etcd: str | None) -> str:
        """Where its nodes meet: the bench's etcd, a port of its own, a lighthouse."""
        ...

    def start(self, job: Job) -> None:
        """What the job needs before its first node (a lighthouse); recorded on the job,
        which stops it with the nodes."""
        ...

    def node(self, job: Job, index: int) -> NodeCommand:
        """Node ``index`` of ``job`` (0 first; a node added later gets the next index)."""
        ...

    def first_node_hosts(self) -> bool:
        """True when the first node hosts the rendezvous: the others start once it
        listens, and it is never the one a fault kills."""
        ...
