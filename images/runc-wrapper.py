#!/usr/bin/python3
"""A runc that drops CAP_SYS_RESOURCE from every container it creates, then is runc.

Registered with our dockerd as its default runtime (images/engine.sh). On hosts where
root itself lacks CAP_SYS_RESOURCE (these VMs), runc cannot give a container a capability
its caller does not hold and fails with "unable to apply caps"; privileged containers
(a kind node) ask for every capability. Everything else is passed to runc untouched.
"""

import json
import os
import sys

DROPPED = "CAP_SYS_RESOURCE"
RUNC = os.environ.get("ELASTICJOB_RUNC", "/usr/sbin/runc")


def bundle_of(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg in ("--bundle", "-b") and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--bundle="):
            return arg.split("=", 1)[1]
    return None


def drop_capability(bundle: str) -> None:
    path = os.path.join(bundle, "config.json")
    with open(path) as f:
        config = json.load(f)
    caps = config.get("process", {}).get("capabilities") or {}
    changed = False
    for kind, names in caps.items():
        if isinstance(names, list) and DROPPED in names:
            caps[kind] = [n for n in names if n != DROPPED]
            changed = True
    if changed:
        with open(path + ".tmp", "w") as f:
            json.dump(config, f)
        os.replace(path + ".tmp", path)


def main() -> None:
    args = sys.argv[1:]
    if "create" in args or "run" in args:
        bundle = bundle_of(args) or os.getcwd()
        if os.path.exists(os.path.join(bundle, "config.json")):
            drop_capability(bundle)
    os.execv(RUNC, [RUNC, *args])


if __name__ == "__main__":
    main()
