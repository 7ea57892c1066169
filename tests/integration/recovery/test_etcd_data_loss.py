"""A job's etcd replaced by an empty one, then a third node: real agents, real etcd.

The integration twin of tests/e2e/test_elastic_training.py::
test_deleting_the_jobs_etcd_pod_is_survived, which failed this way: after the etcd pod
was replaced on an empty volume, each agent's lease keeper was cut off with the old pod
(it never refreshed again), so every member lease an agent's join took anew lapsed a TTL
later; its peers, and the agent itself, took it for a lost peer and the rounds churned
(rounds 2..9 in ten seconds). When the job was scaled to 3, the round of three was
sealed, its rank 0's lease lapsed, the new node abandoned it, and the two others waited
the round store's 300 s in torch's rank assignment while the new node trained alone,
from scratch, to the end.

Here etcd is stopped, its data directory deleted and started again on the same port;
the two first agents run ``workers/cut_keeper_launcher.py``, whose keeper connections
stop answering at that moment (deterministically, where the e2e cluster did so by
chance); the third is a plain ``elasticjob-run``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
from conftest import WORKERS, EtcdServer, launcher_argv, start_etcd

pytestmark = [pytest.mark.integration, pytest.mark.slow]

T = TypeVar("T")
CUT_LAUNCHER = [sys.executable, str(WORKERS / "cut_keeper_launcher.py")]
TRAIN = [
    "-m",
    "elasticjob_examples.train_regression",
    "--steps=100000",
    "--epochs=1000",
    "--sleep=0.1",
    "--log-every=2",
    "--checkpoint-interval=10",
]
STREAK = 30  # steps in one round at world 3: a round that holds for several lease TTLs


@dataclass(frozen=True)
class Step:
    step: int
    world: int
    t: float


def fields(line: str) -> dict[str, str]:
    return dict(tok.split("=", 1) for tok in line.split() if "=" in tok)


class Agents:
    """The agents of one run, their logs, and what rank 0 logged there."""

    def __init__(self, tmp: Path, endpoint: str, cut: Path) -> None:
        self.tmp, self.endpoint, self.cut = tmp, endpoint, cut
        self.run_id = f"etcd-loss-{uuid.uuid4().hex[:8]}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def start(self, launcher: list[str] | None) -> None:
        i = len(self.procs)
        log = self.tmp / f"agent{i}.log"
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
        env = {
            **clean,
            "PYTHONUNBUFFERED": "1",
            "ELASTICJOB_CHECKPOINT_DIR": str(self.tmp / f"ckpt{i}"),  # node-local, as on pods
            "ELASTICJOB_CHECKPOINT_MEMORY_DIR": "off",
            "ELASTICJOB_TEST_KEEPER_CUT": str(self.cut),
        }
        cmd = launcher_argv(
            self.endpoint, self.run_id, TRAIN, nnodes="1:3", max_restarts=3, launcher=launcher
        )
        self.procs.append(
            subprocess.Popen(
                cmd,
                stdout=log.open("wb"),
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        )
        self.logs.append(log)

    def lines(self, since: dict[Path, int] | None = None) -> list[str]:
        """Every agent's lines (only those after the ``mark()`` given as ``since``)."""
        out = []
        for log in self.logs:
            if log.exists():
                lines = log.read_text(errors="replace").splitlines()
                out += lines[(since or {}).get(log, 0) :]
        return out

    def mark(self) -> dict[Path, int]:
        """How many lines each log has now."""
        return {log: len(log.read_text(errors="replace").splitlines()) for log in self.logs}

    def steps(self) -> list[Step]:
        out = [
            Step(int(f["step"]), int(f["world"]), float(f["t"]))
            for f in (fields(line) for line in self.lines() if line.startswith("step="))
        ]
        return sorted(out, key=lambda s: s.t)

    def starts(self) -> list[tuple[str, float]]:
        """How rank 0 began each round it began: 'starting fresh', 'resumed from step N'
        or 'regrouped at step N', with its time."""
        return [
            (line, float(fields(line)["t"]))
            for line in self.lines()
            if line.startswith(("starting fresh", "resumed from step", "regrouped at step"))
        ]

    def took_themselves_for_lost(self, since: dict[Path, int]) -> list[str]:
        """Lines (after ``since``) where an agent's round ended because its own member
        lease lapsed: it named itself among the peers its round lost."""
        bad = []
        for line in self.lines(since):
            marker = " restarts its workers: lost peer(s) "
            if marker not in line or "etcd-v3: " not in line:
                continue
            node = line.split("etcd-v3: ", 1)[1].split()[0]
            if node in line.split(marker, 1)[1].split(", "):
                bad.append(line)
        return bad

    def wait_for(self, what: str, check: Callable[[], T | None], timeout: float) -> T:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.5)
        tails = "\n".join(
            f"--- {log.name} ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            for log in self.logs
            if log.exists()
        )
        pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{tails}")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


@pytest.fixture
def etcd_and_agents(tmp_path: Path) -> Iterator[tuple[EtcdServer, Agents]]:
    server = start_etcd("3.5", tmp_path / "etcd")
    agents = Agents(tmp_path, server.endpoint, tmp_path / "keeper-cut")
    try:
        yield server, agents
    finally:
        agents.stop()
        server.stop()


def steps_in_one_round_at_world(agents: Agents, world: int, since: float) -> int:
    """How many steps the latest round (begun after ``since``) has run at ``world``: a
    round that breaks every lease TTL, regrouping in place at the same world, never gets
    far (0.1 s a step, so 30 steps hold for 3 s: several TTLs)."""
    begun = max((t for _, t in agents.starts() if t > since), default=since)
    run = [s for s in agents.steps() if s.t > begun]
    if not run or any(s.world != world for s in run):
        return 0
    return run[-1].step - run[0].step


def test_after_an_etcd_data_loss_that_cuts_off_the_lease_keepers_the_group_grows_to_three(
    etcd_and_agents: tuple[EtcdServer, Agents], tmp_path: Path
) -> None:
    server, agents = etcd_and_agents
    agents.start(CUT_LAUNCHER)
    agents.start(CUT_LAUNCHER)
    agents.wait_for(
        "the first two to train at world 2",
        lambda: any(s.world == 2 and s.step >= 20 for s in agents.steps()),
        240,
    )
    before = max(s.step for s in agents.steps())

    # the job's etcd pod replaced on an empty volume; the keepers stay on the old one
    agents.cut.touch()
    server.stop()
    shutil.rmtree(tmp_path / "etcd" / "data")
    server.restart()
    lost_at = time.time()
    agents.wait_for(
        "training at world 2 past the step before the loss",
        lambda: any(
            s.t > lost_at and s.world == 2 and s.step > before + 10 for s in agents.steps()
        ),
        120,
    )

    scaled_at, mark = time.time(), agents.mark()
    agents.start(None)  # a new pod: plain elasticjob-run, connected to the new etcd
    agents.wait_for(
        f"a round at world 3 that holds for {STREAK} steps",
        lambda: steps_in_one_round_at_world(agents, 3, scaled_at) >= STREAK,
        150,
    )

    fresh = [line for line, t in agents.starts() if t > lost_at and line.startswith("starting")]
    assert not fresh, f"a group trained from scratch after the etcd loss: {fresh}"
    # the cut-off agents' leases hold from the scale-up on: none of them lapsed
    assert not agents.took_themselves_for_lost(mark)
    # every group after the loss resumed from the training so far, none from step 0
    assert all(s.step >= before for s in agents.steps() if s.t > scaled_at)
