"""What the node agent tells container_init about one container start, as a typed record.

The agent writes it to `<pod dir>/containers/<name>-<n>.json`; container_init reads it
in the container's first process. Defining the record once keeps the two sides of
that file in step. NamedTuple, not dataclass: container_init runs before the exec of
every container and imports nothing it can avoid (dataclasses pulls in inspect).
A start that fails writes its message to `error_path(spec file)` (kubelet's StartError).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple


class SpecError(ValueError):
    """A container spec file that is not what the agent writes."""


class Mount(NamedTuple):
    """A bind mount of a host path (file or directory) at a path in the container."""

    source: str
    target: str
    read_only: bool = False

    @classmethod
    def from_obj(cls, obj: Any) -> Mount:
        if not isinstance(obj, dict) or not {"source", "target"} <= obj.keys():
            raise SpecError(f"a mount needs 'source' and 'target', got {obj!r}")
        return cls(str(obj["source"]), str(obj["target"]), bool(obj.get("read_only")))


class ContainerSpec(NamedTuple):
    """Everything container_init needs to become the container and exec its command."""

    netns: str  # path of the pod's netns; "" for hostNetwork pods
    hostname: str
    hosts_file: str  # bind-mounted at /etc/hosts; "" for none
    mounts: tuple[Mount, ...]
    working_dir: str  # "" for the image's default (here: /)
    argv: tuple[str, ...]
    env: dict[str, str]
    cgroup: str  # the container's cgroup; "" where there is no cgroup v2 to use

    def to_json(self) -> str:
        obj = self._asdict()
        obj["mounts"] = [m._asdict() for m in self.mounts]
        obj["argv"] = list(self.argv)
        return json.dumps(obj)

    @classmethod
    def from_json(cls, text: str) -> ContainerSpec:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(f"container spec is not JSON: {e}") from e
        if not isinstance(obj, dict):
            raise SpecError("container spec must be a JSON object")
        missing = [f for f in ("hostname", "argv", "env") if f not in obj]
        if missing:
            raise SpecError(f"container spec lacks {', '.join(missing)}")
        argv = [str(a) for a in obj["argv"]]
        if not argv:
            raise SpecError("container spec has an empty argv: nothing to exec")
        return cls(
            netns=str(obj.get("netns") or ""),
            hostname=str(obj["hostname"]),
            hosts_file=str(obj.get("hosts_file") or ""),
            mounts=tuple(Mount.from_obj(m) for m in obj.get("mounts") or []),
            working_dir=str(obj.get("working_dir") or ""),
            argv=tuple(argv),
            env={str(k): str(v) for k, v in obj["env"].items()},
            cgroup=str(obj.get("cgroup") or ""),
        )

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())

    @classmethod
    def read(cls, path: Path) -> ContainerSpec:
        return cls.from_json(path.read_text())


def error_path(spec_path: Path) -> Path:
    """Where container_init leaves the reason it could not start the command."""
    return spec_path.with_name(spec_path.name + ".error")
