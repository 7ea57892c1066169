"""The same command run again after its run finished: exit 0, as for a late scale-up pod
(a pod restarted after success must not fail its job), but not silently: one warning on
stderr names the run, says it finished, and how to start afresh. Real agents, real etcd."""

from __future__ import annotations

import os
import subprocess
import textwrap
import uuid
from pathlib import Path

import pytest
from conftest import EtcdServer, launcher_argv, start, wait_for

from elasticjob_runtime import contract

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent(
    """
    import os, sys
    # one write: two unbuffered workers share the log, and print() writes word by word
    sys.stdout.write(f"trained {os.environ['RANK']}\\n")
    """
)


def test_running_a_finished_run_again_exits_0_with_one_warning_on_how_to_start_afresh(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = f"finished-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "first.log"
    first = start(
        agents, etcd, log, [str(script)], launcher_flags=("--no-warm-spares",), run_id=run
    )
    assert wait_for("the first run to end", lambda: first.poll(), 120, log) == 0
    assert "trained 0" in log.read_text()

    argv = launcher_argv(etcd.endpoint, run, [str(script)], nproc=2)
    argv[3:3] = ["--no-warm-spares"]
    # warnings only: the line must not be one a quieter LOGLEVEL hides with the chatter
    again = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LOGLEVEL": "WARNING", "PYTHONUNBUFFERED": "1"},
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "trained" not in again.stdout + again.stderr  # no worker started
    [line] = [line for line in again.stderr.splitlines() if run in line]
    assert f"run {run} finished training before this node joined" in line
    assert "another --rdzv-id" in line
    assert f"etcdctl del --prefix {contract.run_prefix(run)}" in line
    assert etcd.endpoint in line
