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

It also failed a second way, which the e2e test had shown as a group that trained no step
for 5 minutes: a node whose next round started before its run's lease was replaced wrote
its rank-assignment role in the round's store under the lost lease, and the store retried
that write for its 300 s timeout while the others waited for the role; the node stayed
live, so a round with the third node waited the 15 s last call for it and sealed without
it, and no round of three came until the 300 s were up.

Here etcd is stopped, its data directory deleted and started again on the same port;
the two first agents run ``workers/cut_keeper_launcher.py``, whose keeper connections
stop answering at that moment (deterministically, where the e2e cluster did so by
chance) and whose keepers never check the run's lease on their own; the third is a plain
``elasticjob-run``. The scale-up waits until both cut-off keepers were replaced, so
nothing the test checks depends on how fast that happened.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
from conftest import WORKERS, EtcdServer, cut_off_keepers, launcher_argv, start_etcd
from torch.distributed.elastic.rendezvous import RendezvousInfo

from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.etcd.endpoints import parse_endpoints
from elasticjob_runtime.rendezvous import leases
from elasticjob_runtime.rendezvous.handler import EtcdV3RendezvousHandler
from elasticjob_runtime.rendezvous.keys import state_key
from elasticjob_runtime.rendezvous.membership import Limits, Round, RoundCause

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
KEEPER_REPLACED = "starting a new one on a new connection"  # lease_holder.py's warning


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

    def keepers_replaced(self, agents: int) -> bool:
        """Whether each of the first ``agents`` has replaced its cut-off lease keeper."""
        return all(
            log.exists() and KEEPER_REPLACED in log.read_text(errors="replace")
            for log in self.logs[:agents]
        )

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
    # each node learns of the loss on its own (its round watch, a refused write) and
    # replaces its keeper then; scaling up before both have would let a lease the old
    # keeper was meant to keep lapse during the checks below
    agents.wait_for("both cut-off keepers to be replaced", lambda: agents.keepers_replaced(2), 60)
    replaced_at = time.time()
    agents.wait_for(
        "training at world 2 past the step before the loss",
        lambda: any(
            s.t > replaced_at and s.world == 2 and s.step > before + 10 for s in agents.steps()
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


def within(seconds: float, call: Callable[[], T]) -> T:
    """``call``'s result, failing the test if it takes longer than ``seconds`` (it goes
    on in a daemon thread: the old store retried a refused write for 300 s)."""
    done: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            done.append(call())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not errors, errors
    assert done, f"still not done after {seconds:.0f}s"
    return done[0]


def join(node: EtcdV3RendezvousHandler) -> tuple[threading.Thread, list[RendezvousInfo]]:
    """Start ``node`` joining the next round; the list gets its result once it has one."""
    got: list[RendezvousInfo] = []
    thread = threading.Thread(target=lambda: got.append(node.next_rendezvous()), daemon=True)
    thread.start()
    return thread, got


def until(check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:.0f}s"
        time.sleep(0.05)


def forming(client: EtcdClient, run_id: str) -> Round | None:
    """The round key now."""
    kv = client.get(state_key(run_id))
    return None if kv is None else Round.decode(kv.value)


def test_a_node_that_only_entered_a_round_since_the_loss_writes_to_its_store_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race behind both failures, in one process with its order forced: after the
    loss, node b only enters the round a opens, so none of its writes had been refused
    for the run's lease, and its keeper (cut off, then replaced) has not checked that
    lease yet. Its rank-assignment role in the round's store was then written under the
    lost lease, refused, and retried for the store's 300 s while a waited for it. The same
    for a run's lease lost once the round has started."""
    monkeypatch.setattr(leases, "JOB_LEASE_REFRESH_S", 1e9)  # as cut_keeper_launcher.py
    cut, never = cut_off_keepers(monkeypatch)
    server = start_etcd("3.5", tmp_path / "etcd")
    run_id = f"etcd-loss-{uuid.uuid4().hex[:8]}"
    clients = [EtcdClient(parse_endpoints(server.endpoint), timeout=5) for _ in range(3)]
    a, b = (
        EtcdV3RendezvousHandler(c, run_id, Limits(2, 2, last_call=15), "127.0.0.1")
        for c in clients[:2]
    )
    reader = clients[2]
    try:
        for node in (a, b):
            node.register()
        first = [join(a), join(b)]
        for thread, _ in first:
            thread.join(60)
        assert all(got for _, got in first), "round 1 did not form"

        cut.set()
        server.stop()
        shutil.rmtree(tmp_path / "etcd" / "data")
        server.restart()
        # each node's round watch finds the round gone, and its own member key with it:
        # it announces the node again (with a new keeper: the old one is cut off)
        until(lambda: a.num_nodes_waiting() > 0, 15)
        until(lambda: b.num_nodes_waiting() > 0, 15)

        opener, opened = join(a)  # a opens the next round and leads it: two are needed
        # (the state is gone: to a, as to the run's first node, a round to start)
        opening = Round(number=2, leader=a.node, cause=RoundCause.START)
        until(lambda: forming(reader, run_id) == opening, 15)
        info = within(30, b.next_rendezvous)  # b only enters it
        opener.join(30)
        assert opened and info.world_size == 2
        # torch's agent assigns the ranks in the round's store: every node writes its role
        role = f"torchelastic/role_info/{info.rank}"
        within(10, lambda: info.store.set(role, b"b"))
        # and the run's lease lost after the round started: written anew, not waited on
        reader.revoke(b._leases.job_lease)
        within(10, lambda: info.store.set(role + "/again", b"b"))
    finally:
        never.set()
        for node in (a, b):
            node._leave()
        for client in clients:
            client.close()
        server.stop()
