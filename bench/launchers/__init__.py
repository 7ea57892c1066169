"""The launchers the bench races, by name (``--launchers``): ours and its peers, one
module each behind :class:`bench.launchers.api.Launcher`."""

from __future__ import annotations

from bench.launchers.api import Launcher, NodeCommand, Workload
from bench.launchers.dlrover import DlroverRun
from bench.launchers.elasticjob import ElasticjobRun
from bench.launchers.torchft import Torchft
from bench.launchers.torchrun import Torchrun

__all__ = ["LAUNCHERS", "Launcher", "NodeCommand", "Workload"]

LAUNCHERS: dict[str, Launcher] = {
    launcher.name: launcher
    for launcher in (
        ElasticjobRun(),
        ElasticjobRun(in_place=False),
        ElasticjobRun(fork_spares=False),  # spares import torch afresh, as before the template
        Torchrun("c10d"),
        Torchrun("etcd-v3"),
        Torchft(),  # its lighthouse's default heartbeat timeout (5 s)
        Torchft(heartbeat_ms=1000),  # tuned: a lost group noticed in 1 s
        DlroverRun(),  # DLRover's dlrover-run and its job master (opt-in; not a dependency)
    )
}
