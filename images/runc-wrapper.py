#!/usr/bin/python3
"""A runc that drops CAP_SYS_RESOURCE from every process it starts, then is runc.

Registered with our dockerd as its default runtime (images/engine.sh), and with the
containerd inside each kind node (images/kind). On hosts where root itself lacks
CAP_SYS_RESOURCE (these VMs), runc cannot give a process a capability its caller does
not hold and fails with "unable to apply caps"; privileged containers (a kind node,
kube-proxy in it) and `docker exec --privileged` ask for every capability. The process
spec is the bundle's config.json for `create` and `run`, the --process file for `exec`.
Everything else is passed to runc untouched.
"""

import json
import os
import sys
from typing import Any

DROPPED = "CAP_SYS_RESOURCE"
RUNC = os.environ.get("ELASTICJOB_RUNC", "/usr/sbin/runc")


def option(args: list[str], *names: str) -> str | None:
    """The value of the first of ``names`` given as ``--name V``, ``-n V`` or ``--name=V``."""
    for i, arg in enumerate(args):
        if arg in names and i + 1 < len(args):
            return args[i + 1]
        for name in names:
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def without_capability(process: dict[str, Any]) -> bool:
    """Drops DROPPED from every capability set of an OCI process; True if it was there."""
    caps = process.get("capabilities") or {}
    changed = False
    for kind, names in caps.items():
        if isinstance(names, list) and DROPPED in names:
            caps[kind] = [n for n in names if n != DROPPED]
            changed = True
    return changed


def rewrite(path: str, process_of: Any) -> None:
    with open(path) as f:
        spec = json.load(f)
    if without_capability(process_of(spec)):
        with open(path + ".tmp", "w") as f:
            json.dump(spec, f)
        os.replace(path + ".tmp", path)


def main() -> None:
    args = sys.argv[1:]
    if "create" in args or "run" in args:
        bundle = option(args, "--bundle", "-b") or os.getcwd()
        config = os.path.join(bundle, "config.json")
        if os.path.exists(config):
            rewrite(config, lambda spec: spec.get("process", {}))
    elif "exec" in args:
        process = option(args, "--process", "-p")
        if process and os.path.exists(process):
            rewrite(process, lambda spec: spec)
    os.execv(RUNC, [RUNC, *args])


if __name__ == "__main__":
    main()
