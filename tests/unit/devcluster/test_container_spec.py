"""The container spec the agent writes is exactly what container_init reads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elasticjob_devcluster.container_spec import ContainerSpec, Mount, SpecError, error_path


def spec() -> ContainerSpec:
    return ContainerSpec(
        netns="/run/netns/ej-abc",
        hostname="worker-0",
        hosts_file="/state/pods/u/hosts",
        mounts=(Mount("/state/pods/u/shm", "/dev/shm"), Mount("/cfg", "/etc/cfg", True)),
        working_dir="/work",
        argv=("python", "-c", "print(1)"),
        env={"PATH": "/bin", "A": "b"},
        cgroup="/sys/fs/cgroup/elasticjob/c/n/u/main",
    )


def test_a_spec_survives_the_round_trip_through_its_file(tmp_path: Path) -> None:
    path = tmp_path / "containers" / "main-0.json"
    spec().write(path)
    assert ContainerSpec.read(path) == spec()


def test_the_file_keeps_the_layout_container_init_has_always_read() -> None:
    obj = json.loads(spec().to_json())
    assert set(obj) == {
        "netns",
        "hostname",
        "hosts_file",
        "mounts",
        "working_dir",
        "argv",
        "env",
        "cgroup",
    }
    assert obj["mounts"][1] == {"source": "/cfg", "target": "/etc/cfg", "read_only": True}


def test_optional_fields_may_be_absent_and_default_to_none() -> None:
    got = ContainerSpec.from_json(
        json.dumps(
            {
                "hostname": "h",
                "argv": ["true"],
                "env": {},
                "mounts": [{"source": "/a", "target": "/b"}],
            }
        )
    )
    assert (got.netns, got.hosts_file, got.working_dir, got.cgroup) == ("", "", "", "")
    assert got.mounts == (Mount("/a", "/b", False),)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("not json", "not JSON"),
        ("[]", "must be a JSON object"),
        ('{"hostname": "h", "env": {}}', "lacks argv"),
        ('{"hostname": "h", "argv": [], "env": {}}', "empty argv"),
        ('{"hostname": "h", "argv": ["x"], "env": {}, "mounts": [{"source": "/a"}]}', "target"),
    ],
)
def test_a_bad_spec_is_named_in_one_line(text: str, says: str) -> None:
    with pytest.raises(SpecError, match=says):
        ContainerSpec.from_json(text)


def test_a_start_error_sits_beside_its_spec() -> None:
    assert error_path(Path("/p/containers/main-2.json")) == Path("/p/containers/main-2.json.error")
