"""What the node agent holds for one pod it runs, and where that pod's files live.

Owned by the reconcile loop; the prober and log server threads only read it (the
prober also keeps its probe counters here). Layout under `<node state>/pods/<uid>/`:
hosts, shm/, home/, volumes/<name>/, containers/<name>-<n>.json (container_spec.py),
logs/<name>/<n>.log.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from elasticjob_devcluster.kubeapi import Obj
from elasticjob_devcluster.pod_status import ContainerRun
from elasticjob_devcluster.probes import ProbeState


@dataclass
class PodRuntime:
    uid: str
    namespace: str
    name: str
    dir: Path
    pod: Obj  # the latest from the watch
    ip: str = ""
    netns: str = ""  # "" until the sandbox exists, and for hostNetwork pods
    sandbox: bool = False
    start_time: float = field(default_factory=time.time)
    runs: dict[str, ContainerRun] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)  # running ones
    log_paths: dict[str, list[Path]] = field(default_factory=dict)  # one per start
    phase: str = "Pending"
    kill_deadline: float | None = None  # deleting: when the grace period ends
    last_status: Obj | None = None  # as last posted (None: post again)
    token_refresh_at: float = 0.0
    hosts_text: str = ""
    volumes_ready: bool = False
    torn_down: bool = False
    network_cut: bool = False
    probes: dict[str, ProbeState] = field(default_factory=dict)

    @property
    def spec(self) -> Obj:
        spec: Obj = self.pod.get("spec") or {}
        return spec

    def container(self, name: str) -> Obj:
        """The pod spec's (init) container called `name`; KeyError if there is none."""
        for c in (self.spec.get("initContainers") or []) + (self.spec.get("containers") or []):
            if c["name"] == name:
                found: Obj = c
                return found
        raise KeyError(name)

    @property
    def hosts_path(self) -> Path:
        return self.dir / "hosts"

    @property
    def shm_dir(self) -> Path:
        return self.dir / "shm"

    @property
    def home(self) -> Path:
        return self.dir / "home"

    def volume_dir(self, volume: str) -> Path:
        return self.dir / "volumes" / volume

    def spec_file(self, container: str, start: int) -> Path:
        """The ContainerSpec of a container's start number `start` (0 for the first)."""
        return self.dir / "containers" / f"{container}-{start}.json"

    def log_file(self, container: str, start: int) -> Path:
        return self.dir / "logs" / container / f"{start}.log"
