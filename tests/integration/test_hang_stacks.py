"""The integration tests' own evidence of a hang: a ``wait_for`` that times out fails
with every thread's stack of the agent and its workers (conftest.abort_with_stacks), so
a hang seen once in a full run can be read, not only rerun."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import EtcdServer, start, wait_for

pytestmark = pytest.mark.integration

# It says when it is inside nap_forever, so the stack the test reads is the hang's, not
# the interpreter still starting (on a loaded machine its agent's warm spares alone can
# take longer than the short wait below).
SLEEPER = """import pathlib, sys, time
def nap_forever():
    pathlib.Path(sys.argv[1]).touch()
    time.sleep(3600)
nap_forever()
"""


def test_a_timed_out_wait_fails_with_the_stacks_of_the_agent_and_its_worker(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    napping = tmp_path / "napping"
    log = tmp_path / "agent.log"
    agent = start(agents, etcd, log, [str(script), str(napping)], nproc=1)
    wait_for("the sleeper to start napping", lambda: napping.exists() or None, 180, log)
    with pytest.raises(pytest.fail.Exception) as failed:
        wait_for("the sleeper to finish", agent.poll, 8, log)
    message = str(failed.value)
    assert "timed out after 8s waiting for the sleeper to finish" in message
    # the worker's stack names the function it hangs in; the agent's own is there too
    assert "in nap_forever" in message and "elasticjob_runtime/launch/launcher.py" in message
    assert agent.wait(timeout=30) != 0
