"""images/runc-wrapper.py, run as Docker and the kind nodes' containerd run it: the
process spec of `create`, `run` and `exec` loses CAP_SYS_RESOURCE (root on these hosts
lacks it, so runc would fail to grant it), nothing else changes, and runc gets the
arguments as they came. The runc here is a program that records what it was given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
WRAPPER = REPO / "images" / "runc-wrapper.py"
ALL_CAPS = ["CAP_CHOWN", "CAP_NET_ADMIN", "CAP_SYS_ADMIN", "CAP_SYS_RESOURCE"]
SETS = ("bounding", "effective", "permitted", "inheritable")


def process(caps: list[str]) -> dict[str, Any]:
    return {"args": ["sh"], "capabilities": {s: list(caps) for s in SETS}}


def run_wrapper(tmp_path: Path, *args: str) -> list[str]:
    """Runs the wrapper; returns the arguments the recording runc received."""
    seen = tmp_path / "runc-args.json"
    runc = tmp_path / "runc"
    runc.write_text(
        f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(seen)!r}, 'w'))\n"
    )
    runc.chmod(0o755)
    env = {**os.environ, "ELASTICJOB_RUNC": str(runc)}
    subprocess.run([sys.executable, str(WRAPPER), *args], env=env, check=True, timeout=30)
    result: list[str] = json.loads(seen.read_text())
    return result


def test_exec_drops_the_capability_from_the_process_file_and_passes_the_arguments_on(
    tmp_path: Path,
) -> None:
    spec = tmp_path / "process.json"
    spec.write_text(json.dumps(process(ALL_CAPS)))
    args = ["--root", "/run/x", "exec", "--process", str(spec), "--detach", "id1"]
    assert run_wrapper(tmp_path, *args) == args
    caps = json.loads(spec.read_text())["capabilities"]
    assert caps == {s: ["CAP_CHOWN", "CAP_NET_ADMIN", "CAP_SYS_ADMIN"] for s in SETS}


def test_create_drops_the_capability_from_the_bundles_config(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    config = {"ociVersion": "1.0.2", "process": process(ALL_CAPS), "root": {"path": "rootfs"}}
    (bundle / "config.json").write_text(json.dumps(config))
    args = ["--systemd-cgroup", "create", f"--bundle={bundle}", "id2"]
    assert run_wrapper(tmp_path, *args) == args
    rewritten = json.loads((bundle / "config.json").read_text())
    assert "CAP_SYS_RESOURCE" not in rewritten["process"]["capabilities"]["bounding"]
    assert rewritten["root"] == {"path": "rootfs"}  # the rest of the spec as it was


def test_a_spec_without_the_capability_is_not_rewritten(tmp_path: Path) -> None:
    spec = tmp_path / "process.json"
    original = json.dumps(process(["CAP_CHOWN"]), indent=1)
    spec.write_text(original)
    run_wrapper(tmp_path, "exec", "-p", str(spec), "id3")
    assert spec.read_text() == original
