"""A job of its own network namespace: for peers whose servers listen on every interface
(torchft's manager, DLRover's master), so that nothing of theirs is reachable beyond
the namespace's loopback."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.harness import Job


def namespace_of(job: Job) -> str:
    return f"ej-bench-{job.run_id}"


def in_namespace(job: Job, argv: list[str]) -> list[str]:
    """``argv`` run inside the job's namespace."""
    return ["ip", "netns", "exec", namespace_of(job), *argv]


def start_service(job: Job, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    """Create the job's namespace (loopback up) and start ``argv`` inside it, logging to
    ``log``; job.stop stops the process and then removes the namespace."""
    ns = namespace_of(job)
    subprocess.run(["ip", "netns", "add", ns], check=True)
    job.cleanups.append(lambda: subprocess.run(["ip", "netns", "delete", ns], check=False))
    subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
    job.services.append(
        subprocess.Popen(
            in_namespace(job, argv),
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    )
