"""SIGTERM reaches a worker whose main thread is stuck in a collective with a frozen peer.

Python runs signal handlers in the main thread between bytecodes, and a worker blocked
inside gloo's all_reduce never gets there: before the wakeup-fd watcher, such a worker
ignored SIGTERM until torch's agent SIGKILLed it 30 s later, which made every
membership restart after a frozen node 30 s slower for scripts using the handler.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WORKER = """
import os, sys, time
import torch, torch.distributed as dist
from elasticjob_runtime.checkpoints.manager import CheckpointManager

rank, out = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
ckpt = CheckpointManager(f"{out}/ckpt{rank}", memory=False)
ckpt.install_sigterm_handler(grace_s=float(os.environ.get("TEST_GRACE", "2")))
ckpt.track({"weights": torch.ones(3)})
ckpt.mark_step(7)
print("ready", flush=True)
t = torch.ones(1)
while True:
    dist.all_reduce(t)
    time.sleep(0.01)
"""


@pytest.fixture
def ranks(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[list[subprocess.Popen[bytes]]]:
    extra: dict[str, str] = getattr(request, "param", {})
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            **{k: v.format(tmp=tmp_path) for k, v in extra.items()},
        }
        log = (tmp_path / f"rank{rank}.log").open("wb")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(rank), str(tmp_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        )
    yield procs
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def freeze_rank1_and_sigterm_rank0(
    tmp_path: Path, ranks: list[subprocess.Popen[bytes]]
) -> tuple[int, float, str]:
    """Rank 0 blocked in all_reduce with a frozen rank 1, then SIGTERMed: exit code,
    seconds to exit, rank 0's log."""
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    deadline = time.monotonic() + 120
    while not all(log.exists() and b"ready" in log.read_bytes() for log in logs):
        assert time.monotonic() < deadline, "workers did not start:\n" + logs[0].read_text()
        assert all(p.poll() is None for p in ranks), logs[0].read_text() + logs[1].read_text()
        time.sleep(0.2)

    os.kill(ranks[1].pid, signal.SIGSTOP)  # the frozen peer: no reset connection
    time.sleep(1.0)  # rank 0 is now blocked inside all_reduce
    sent = time.monotonic()
    os.kill(ranks[0].pid, signal.SIGTERM)
    try:
        code = ranks[0].wait(timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("rank 0 ignored SIGTERM while blocked in a collective:\n" + logs[0].read_text())
    return code, time.monotonic() - sent, logs[0].read_text()


def test_a_worker_stuck_in_a_collective_saves_and_exits_after_sigterm_within_its_grace(
    tmp_path: Path, ranks: list[subprocess.Popen[bytes]]
) -> None:
    code, took, log = freeze_rank1_and_sigterm_rank0(tmp_path, ranks)
    assert code == 128 + signal.SIGTERM
    assert took < 15, f"exit took {took:.1f}s"
    assert "saving from the watchdog" in log
    assert (tmp_path / "ckpt0" / "step-0000000007.pt.commit").exists()


# the agent channel elasticjob-run's agent would own (channel.py): only its group-broken mark
BROKEN = {"TEST_GRACE": "60", "ELASTICJOB_AGENT_CHANNEL": "{tmp}"}


@pytest.mark.parametrize("ranks", [BROKEN], indirect=True)
def test_a_worker_told_its_group_lost_a_peer_saves_at_once_instead_of_waiting_its_grace(
    tmp_path: Path, ranks: list[subprocess.Popen[bytes]]
) -> None:
    # What elasticjob-run's agent does before stopping workers whose round lost a peer.
    (tmp_path / "group-broken").touch()
    code, _, log = freeze_rank1_and_sigterm_rank0(tmp_path, ranks)  # waits at most 20 s
    assert code == 128 + signal.SIGTERM
    assert "the group lost a peer" in log and "saving from the watchdog" not in log
    assert (tmp_path / "ckpt0" / "step-0000000007.pt.commit").exists()
