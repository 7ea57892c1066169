"""An operator started while the API server cannot be reached tries its startup again
within seconds, not after kopf's default minute (which the liveness probe never waits
out: the pod was killed and the jobs waited for nothing)."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

from elasticjob_operator.handlers import startup_retry_delay


def test_the_retries_double_from_a_second_to_at_most_ten() -> None:
    assert [startup_retry_delay(n) for n in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_kopf_retries_a_startup_that_cannot_reach_the_api_server_within_seconds(
    tmp_path: Path,
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: x\n"
        f"clusters: [{{name: c, cluster: {{server: 'https://127.0.0.1:{closed_port()}'}}}}]\n"
        "contexts: [{name: x, context: {cluster: c, user: u}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
    )
    kopf = shutil.which("kopf")
    assert kopf is not None
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "ELASTICJOB_NETWORK_POLICY": "false"}
    cmd = [kopf, "run", "--standalone", "-m", "elasticjob_operator.handlers", "--namespace", "x"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    failed_at: list[float] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if re.search(r"Activity 'startup' failed temporarily: cannot start yet", line):
                failed_at.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while len(failed_at) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        reader.join(timeout=10)
    assert len(failed_at) >= 3, f"startup attempts seen: {len(failed_at)}"
    gaps = [b - a for a, b in itertools.pairwise(failed_at[:3])]
    assert all(g < 5.0 for g in gaps), gaps  # 1 s, then 2 s (kopf's own default: 60 s)
