"""The images as a user runs them: built by ``make images`` (images/build.sh, which this
fixture runs: cached, so a second run only checks), started with ``docker run``.

Every container and network a test creates is recorded and removed by its id.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("ELASTICJOB_CACHE", Path.home() / ".cache" / "elasticjob"))
TAG = os.environ.get("IMAGE_TAG", "dev")
OPERATOR = f"elasticjob-operator:{TAG}"
RUNTIME = f"elasticjob-runtime:{TAG}"
ETCD = f"elasticjob-etcd:{TAG}"  # our etcd 3.6 binary on the base image, for these tests


@dataclass
class Docker:
    """The docker CLI against the engine the images were built on; what it started."""

    host: str
    containers: list[str] = field(default_factory=list)
    networks: list[str] = field(default_factory=list)

    def __call__(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        out = subprocess.run(
            ["docker", *args],
            env={**os.environ, "DOCKER_HOST": self.host},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and out.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)}: {out.stderr.strip()[-2000:]}")
        return out.stdout

    def logs(self, cid: str) -> str:
        """A container's output, stdout and stderr interleaved."""
        out = subprocess.run(
            ["docker", "logs", cid],
            env={**os.environ, "DOCKER_HOST": self.host},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=60,
        )
        return out.stdout

    def run(self, *args: str) -> str:
        """``docker run -d``; the container's id, recorded for removal."""
        cid = self("run", "-d", *args).strip()
        self.containers.append(cid)
        return cid

    def network(self, name: str) -> str:
        nid = self("network", "create", "--driver", "bridge", name).strip()
        self.networks.append(nid)
        return nid

    def cleanup(self) -> None:
        for cid in self.containers:
            self("rm", "-f", cid, check=False)
        for nid in self.networks:
            self("network", "rm", nid, check=False)
        self.containers.clear()
        self.networks.clear()


@pytest.fixture(scope="session")
def built() -> Iterator[str]:
    """Both images built (images/build.sh); the DOCKER_HOST they are on. The Docker engine
    we started for them (if we did) is stopped at the end, by its recorded pid."""
    out = subprocess.run(
        [str(REPO / "images" / "build.sh")],
        env={**os.environ, "IMAGE_TAG": TAG},
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert out.returncode == 0, f"images/build.sh failed:\n{out.stderr[-4000:]}"
    lines = [line for line in out.stdout.splitlines() if line.startswith("DOCKER_HOST=")]
    assert lines, out.stdout
    yield lines[-1].split("=", 1)[1]
    subprocess.run([str(REPO / "images" / "engine.sh"), "down"], timeout=120, check=False)


@pytest.fixture
def docker(built: str) -> Iterator[Docker]:
    d = Docker(built)
    yield d
    d.cleanup()


@pytest.fixture(scope="session")
def etcd_image(built: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """etcd 3.6 (the binary ``make setup`` builds for the devcluster) on the base image."""
    found = sorted((CACHE / "bin").glob("*etcd-v3.6*/etcd"))
    assert found, f"no etcd 3.6 under {CACHE}/bin: run `make setup`"
    context = tmp_path_factory.mktemp("etcd-image")
    (context / "etcd").write_bytes(found[-1].read_bytes())
    (context / "etcd").chmod(0o755)
    (context / "Dockerfile").write_text(
        "ARG BASE\nFROM ${BASE}\nCOPY etcd /usr/local/bin/etcd\n"
        'USER 65532:65532\nENTRYPOINT ["etcd"]\n'
    )
    Docker(built)(
        "build", "--build-arg", "BASE=elasticjob-python:3.11-bookworm", "-t", ETCD, str(context)
    )
    return ETCD
