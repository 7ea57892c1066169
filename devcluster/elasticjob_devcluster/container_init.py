"""Turns this process into a pod's container, then execs the container's command.

Run by the node agent as `python -m elasticjob_devcluster.container_init SPEC.json`
(a ContainerSpec, see container_spec.py): enters the container's cgroup, joins the
pod's network namespace, takes private mount and UTS namespaces (so the pod's
hostname, /etc/hosts and volume mounts are visible to it alone), sets the hostname,
bind-mounts the volumes and the hosts file, detaches the copies of the pods' tmpfs
mounts it inherited from the agent, changes to workingDir and execs, so the pid the
agent recorded is the container's own process. A setup failure exits 128, like a
runtime that cannot start a container. Imports stay few: this runs before every
container's command.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from pathlib import Path

from elasticjob_devcluster import cgroups, volumes
from elasticjob_devcluster.container_spec import ContainerSpec, SpecError, error_path

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, flags: int) -> None:
    src = source.encode() if source is not None else None
    _check(_libc.mount(src, target.encode(), None, flags, None), f"mount {source} on {target}")


def _mountpoint(target: Path, source_is_dir: bool) -> None:
    """Create what a bind mount needs to land on (a directory, or an empty file)."""
    if target.exists():
        return
    if source_is_dir:
        target.mkdir(parents=True, exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()


def enter(spec: ContainerSpec) -> None:
    if spec.netns:  # empty for hostNetwork pods
        fd = os.open(spec.netns, os.O_RDONLY)
        try:
            _check(_libc.setns(fd, CLONE_NEWNET), "setns net")
        finally:
            os.close(fd)
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare mount+uts")
    _mount(None, "/", MS_REC | MS_PRIVATE)
    hostname = spec.hostname.encode()
    _check(_libc.sethostname(hostname, len(hostname)), "sethostname")
    for m in spec.mounts:
        _mountpoint(Path(m.target), Path(m.source).is_dir())
        _mount(m.source, m.target, MS_BIND | MS_REC)
        if m.read_only:
            _mount(None, m.target, MS_BIND | MS_REMOUNT | MS_RDONLY)
    if spec.hosts_file:
        _mount(spec.hosts_file, "/etc/hosts", MS_BIND)
    volumes.detach_other_pod_tmpfs({os.path.normpath(m.target) for m in spec.mounts})
    if spec.working_dir:
        os.makedirs(spec.working_dir, exist_ok=True)
        os.chdir(spec.working_dir)


def main() -> None:
    if len(sys.argv) != 2:
        sys.stderr.write("usage: python -m elasticjob_devcluster.container_init SPEC.json\n")
        sys.exit(2)
    spec_path = Path(sys.argv[1])
    try:
        spec = ContainerSpec.read(spec_path)
    except (OSError, SpecError) as e:
        sys.stderr.write(f"devcluster: cannot read container spec {spec_path}: {e}\n")
        sys.exit(2)
    argv = list(spec.argv)
    try:
        if spec.cgroup:  # first, so everything the command starts is in it too
            cgroups.enter(Path(spec.cgroup))
        enter(spec)
        os.execvpe(argv[0], argv, spec.env)
    except OSError as e:
        message = f"devcluster: cannot start container command {argv[0]!r}: {e.strerror or e}"
        sys.stderr.write(message + "\n")
        # tells the agent this was a start failure (kubelet's StartError), not an exit 128
        with contextlib.suppress(OSError):
            error_path(spec_path).write_text(message)
        sys.exit(128)


if __name__ == "__main__":
    main()
