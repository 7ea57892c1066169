"""The integration tests' own evidence of a hang: a ``wait_for`` that times out fails
with every thread's stack of the agent and its workers (conftest.abort_with_stacks), so
a hang seen once in a full run can be read, not only rerun."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import EtcdServer, start, wait_for

pytestmark = pytest.mark.integration

SLEEPER = "import time\ndef nap_forever():\n    time.sleep(3600)\nnap_forever()\n"


def test_a_timed_out_wait_fails_with_the_stacks_of_the_agent_and_its_worker(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    log = tmp_path / "agent.log"
    agent = start(agents, etcd, log, [str(script)], nproc=1)
    with pytest.raises(pytest.fail.Exception) as failed:
        wait_for("the sleeper to finish", agent.poll, 8, log)
    message = str(failed.value)
    assert "timed out after 8s waiting for the sleeper to finish" in message
    # the worker's stack names the function it hangs in; the agent's own is there too
    assert "in nap_forever" in message and "elasticjob_runtime/launch/launcher.py" in message
    assert agent.wait(timeout=30) != 0
