"""Detecting a lost node through its 1 s member lease, on real etcd: a frozen agent is
noticed within seconds, and a machine loaded on every core raises no false alarm.

Each agent here is a separate process (hold_lease.py) holding a real handler, started in
its own session and stopped by its recorded pid. Time bounds are generous; the measured
detection time belongs to the benchmark's node-freeze scenario.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import WORKERS, EtcdServer, start_etcd

from elasticjob_devcluster.network import pipe
from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.etcd.endpoints import parse_endpoints
from elasticjob_runtime.rendezvous.handler import EtcdV3RendezvousHandler
from elasticjob_runtime.rendezvous.keys import members_prefix
from elasticjob_runtime.rendezvous.leases import DEFAULT_LEASE_TTL
from elasticjob_runtime.rendezvous.membership import Limits

pytestmark = pytest.mark.integration

HOLDER = WORKERS / "hold_lease.py"
LOAD_SECONDS = 12.0  # sixty refreshes of each lease under load
# Long enough that a round sealed well before it ran out cannot have waited for it.
LONG_TTL = 10


@dataclass
class Holder:
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path

    def joined(self, timeout: float = 90) -> str:
        """The node name it printed once in a round."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.out.read_text().splitlines():
                if line.startswith("joined "):
                    return line.split()[1]
            assert self.proc.poll() is None, f"the holder exited: {self.err.read_text()[-2000:]}"
            time.sleep(0.05)
        raise AssertionError(f"the holder never joined: {self.err.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # also ends a stopped process
        self.proc.wait(timeout=30)


@pytest.fixture
def start_holder(tmp_path: Path) -> Iterator[Callable[..., Holder]]:
    started: list[Holder] = []

    def start(
        endpoint: str, run_id: str, nnodes: str, seconds: float, busy: bool, lease_ttl: int = 0
    ) -> Holder:
        n = len(started)
        out, err = tmp_path / f"holder{n}.out", tmp_path / f"holder{n}.err"
        cmd = [sys.executable, str(HOLDER), endpoint, run_id, nnodes, str(seconds)]
        proc = subprocess.Popen(
            [
                *cmd,
                *(["--busy"] if busy else []),
                *([f"--lease-ttl={lease_ttl}"] if lease_ttl else []),
            ],
            stdout=out.open("wb"),
            stderr=err.open("wb"),
            start_new_session=True,
        )
        started.append(Holder(proc, out, err))
        return started[-1]

    yield start
    for holder in started:
        holder.stop()


@pytest.fixture
def burners() -> Iterator[Callable[[int, float], list[subprocess.Popen[bytes]]]]:
    """Busy-loop processes that end by themselves after a while (and are killed after the
    test by their recorded pids)."""
    started: list[subprocess.Popen[bytes]] = []

    def start(count: int, seconds: float) -> list[subprocess.Popen[bytes]]:
        code = (
            f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
        )
        for _ in range(count):
            started.append(subprocess.Popen([sys.executable, "-c", code], start_new_session=True))
        return started

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a live process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def member_keys(client: EtcdClient, run_id: str) -> dict[str, tuple[int, int]]:
    """Each live member key with its (mod revision, lease): a key that expired and was
    registered again shows a new revision and lease."""
    items = client.snapshot(members_prefix(run_id)).items
    return {key: (kv.mod_revision, kv.lease) for key, kv in items.items()}


def wait_until(check: Callable[[], bool], timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if check():
            return time.monotonic() - started
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout}s")


@dataclass
class Pair:
    """An agent process and an in-process agent of one run."""

    holder: Holder
    agent: EtcdV3RendezvousHandler
    client: EtcdClient  # the in-process agent's
    run_id: str


@contextlib.contextmanager
def agent_pair(
    etcd: EtcdServer, start_holder: Callable[..., Holder], name: str, nnodes: str, ttl: int = 0
) -> Iterator[Pair]:
    """Both on ``ttl`` s leases (0: the default), ``nnodes`` as MIN:MAX; the in-process
    agent leaves after the block."""
    run_id = f"{name}-{uuid.uuid4().hex[:8]}"
    holder = start_holder(etcd.endpoint, run_id, nnodes, seconds=120, busy=False, lease_ttl=ttl)
    client = EtcdClient(parse_endpoints(etcd.endpoint), timeout=10)
    low, high = (int(n) for n in nnodes.split(":"))
    agent = EtcdV3RendezvousHandler(
        client,
        run_id,
        Limits(low, high, 15),
        "127.0.0.1",
        join_timeout=90,
        lease_ttl=ttl or DEFAULT_LEASE_TTL,
    )
    try:
        yield Pair(holder, agent, client, run_id)
    finally:
        agent._leave()
        client.close()


@pytest.fixture
def peer(etcd_any: EtcdServer) -> Iterator[Callable[[str, int], EtcdV3RendezvousHandler]]:
    """An in-process handler (the surviving peer), on the default lease TTL."""
    made: list[tuple[EtcdV3RendezvousHandler, EtcdClient]] = []

    def make(run_id: str, nodes: int) -> EtcdV3RendezvousHandler:
        client = EtcdClient(parse_endpoints(etcd_any.endpoint), timeout=10)
        handler = EtcdV3RendezvousHandler(
            client, run_id, Limits(nodes, nodes, 15), "127.0.0.1", join_timeout=90
        )
        handler.register()
        made.append((handler, client))
        return handler

    yield make
    for handler, client in made:
        handler._leave()
        client.close()


def test_a_frozen_agent_is_noticed_by_its_peer_within_seconds(
    etcd_any: EtcdServer,
    peer: Callable[[str, int], EtcdV3RendezvousHandler],
    start_holder: Callable[..., Holder],
) -> None:
    """Its lease runs out, or the peer watching it (rendezvous/peer_watch.py) revokes it
    after a TTL without an answer, whichever comes first (the next test shows the
    watch alone)."""
    run_id = f"freeze-{uuid.uuid4().hex[:8]}"
    holder = start_holder(etcd_any.endpoint, run_id, "2:2", seconds=120, busy=False)
    a = peer(run_id, 2)
    info = a.next_rendezvous()
    frozen_node = holder.joined()
    assert info.world_size == 2
    assert a.lease_ttl == 1, "our etcd flags should let etcd grant the default 1 s lease"
    time.sleep(1.0)
    assert a.num_nodes_waiting() == 0

    os.kill(holder.proc.pid, signal.SIGSTOP)  # no exit, no closed socket: it just stops
    took = wait_until(lambda: a.num_nodes_waiting() > 0, 15)
    print(f"etcd {etcd_any.version}: a frozen agent was noticed after {took:.2f}s")
    assert took < 5, f"the frozen agent was noticed only after {took:.1f}s"
    assert a.peers_lost() == [frozen_node]


def test_a_frozen_agent_is_dropped_by_the_peer_watching_it_after_a_ttl_of_silence(
    etcd: EtcdServer, start_holder: Callable[..., Holder], caplog: pytest.LogCaptureFixture
) -> None:
    """The test keeps the frozen agent's 1 s lease alive itself, as a lessor that never
    gets round to it would: only the peer watching it can drop it."""
    caplog.set_level("INFO", logger="elasticjob_runtime.rendezvous.peer_watch")
    keeping = threading.Event()
    with agent_pair(etcd, start_holder, "mute", "2:2") as p:
        try:
            assert p.agent.next_rendezvous().world_size == 2
            frozen_node = p.holder.joined()
            ((_, lease),) = [
                v for k, v in member_keys(p.client, p.run_id).items() if frozen_node in k
            ]

            def keep_alive() -> None:
                while not keeping.wait(0.2):
                    p.client.refresh(lease)

            threading.Thread(target=keep_alive, daemon=True).start()
            time.sleep(0.5)  # the watch has had its first answers
            os.kill(p.holder.proc.pid, signal.SIGSTOP)
            took = wait_until(lambda: p.agent.num_nodes_waiting() > 0, LONG_TTL)
            print(f"a frozen peer was dropped by its watcher after {took:.2f}s")
            assert took >= 0.8, f"dropped after {took:.2f}s: before a TTL of silence"
            assert p.agent.peers_lost() == [frozen_node]
            said = [
                r.getMessage() for r in caplog.records if "revoking its member" in r.getMessage()
            ]
            assert len(said) == 1 and "no answer for" in said[0], said
        finally:
            keeping.set()


def test_an_agent_that_died_mid_round_is_dropped_by_its_watcher_without_its_lease(
    etcd: EtcdServer, start_holder: Callable[..., Holder]
) -> None:
    """Between rounds nobody probes; while a round runs, the node watching the one that
    died sees its liveness port close and revokes its 10 s lease at once."""
    with agent_pair(etcd, start_holder, "died", "2:2", LONG_TTL) as p:
        assert p.agent.next_rendezvous().world_size == 2
        dead_node = p.holder.joined()
        time.sleep(0.5)  # the watch has had its first answers
        os.killpg(p.holder.proc.pid, signal.SIGKILL)
        p.holder.proc.wait(timeout=30)
        took = wait_until(lambda: p.agent.num_nodes_waiting() > 0, LONG_TTL * 2)
        print(f"a peer that died mid-round was dropped after {took:.2f}s")
        assert took < LONG_TTL / 2, f"dropped after {took:.1f}s: as late as its lease"
        assert p.agent.peers_lost() == [dead_node]


def next_round_without(
    etcd: EtcdServer, start_holder: Callable[..., Holder], fault: signal.Signals, ttl: int
) -> tuple[float, int]:
    """An in-process agent and an agent process (both on ``ttl`` s leases) meet; the
    process gets ``fault``; the other opens the next round. How long that round took to
    seal, and its world size."""
    with agent_pair(etcd, start_holder, "gone", "1:2", ttl) as p:
        p.agent.register()
        # both live: a round of 2
        wait_until(lambda: len(member_keys(p.client, p.run_id)) == 2, 60)
        assert p.agent.next_rendezvous().world_size == 2
        p.holder.joined()
        os.kill(p.holder.proc.pid, fault)
        if fault == signal.SIGKILL:
            p.holder.proc.wait(timeout=30)  # gone, its sockets with it
        started = time.monotonic()
        world = p.agent.next_rendezvous().world_size
        return time.monotonic() - started, world


def test_an_agent_that_died_is_dropped_from_the_next_round_without_waiting_for_its_lease(
    etcd: EtcdServer, start_holder: Callable[..., Holder], caplog: pytest.LogCaptureFixture
) -> None:
    # Its process is gone but its host is not: its liveness port refuses the leader's
    # connection, and the leader revokes its lease (rendezvous/liveness.py).
    caplog.set_level("INFO", logger="elasticjob_runtime.rendezvous.join_executor")
    took, world = next_round_without(etcd, start_holder, signal.SIGKILL, LONG_TTL)
    print(f"the next round sealed {took:.2f}s after the kill")
    assert world == 1
    assert took < LONG_TTL / 2, f"the round waited {took:.1f}s: as long as the lease"
    said = [r.getMessage() for r in caplog.records if "liveness port refused" in r.getMessage()]
    assert len(said) == 1, said


def test_a_frozen_agent_is_never_dropped_on_a_probe_only_when_its_lease_runs_out(
    etcd: EtcdServer, start_holder: Callable[..., Holder], caplog: pytest.LogCaptureFixture
) -> None:
    # A stopped process's kernel still accepts connections: that proves nothing, so the
    # round waits for the lease (2 s here) as it always has.
    caplog.set_level("INFO", logger="elasticjob_runtime.rendezvous.join_executor")
    took, world = next_round_without(etcd, start_holder, signal.SIGSTOP, 2)
    print(f"the next round sealed {took:.2f}s after the freeze")
    assert world == 1
    assert took > 1.0, f"sealed after {took:.2f}s: before a 2 s lease could run out"
    assert not [r for r in caplog.records if "liveness port refused" in r.getMessage()]


def test_no_lease_is_lost_while_every_core_is_busy(
    etcd: EtcdServer,
    start_holder: Callable[..., Holder],
    burners: Callable[[int, float], list[subprocess.Popen[bytes]]],
) -> None:
    # Two agents whose main threads spin in Python (the keeper thread must still get the
    # GIL) and one burner per core on top: 1 s leases must all hold for the whole time.
    run_id = f"busy-{uuid.uuid4().hex[:8]}"
    client = EtcdClient(parse_endpoints(etcd.endpoint), timeout=10)
    a = EtcdV3RendezvousHandler(client, run_id, Limits(3, 3, 15), "127.0.0.1", join_timeout=90)
    a.register()
    try:
        holders = [
            start_holder(etcd.endpoint, run_id, "3:3", seconds=LOAD_SECONDS + 90, busy=True)
            for _ in range(2)
        ]
        assert a.next_rendezvous().world_size == 3
        for holder in holders:
            holder.joined()
        before = member_keys(client, run_id)
        assert len(before) == 3

        cores = len(os.sched_getaffinity(0))
        burning = burners(cores, LOAD_SECONDS + 30)
        started = time.monotonic()
        alarms = 0
        while time.monotonic() - started < LOAD_SECONDS:
            alarms += a.num_nodes_waiting()
            time.sleep(0.1)
        used = sum(cpu_seconds(p.pid) for p in burning)
        after = member_keys(client, run_id)

        # the load was real: the burners kept (a share of) every core busy throughout
        assert used > 0.2 * cores * LOAD_SECONDS, f"burners used only {used:.1f} CPU s"
        assert alarms == 0, "a peer saw a member leave while none did"
        assert after == before, "a member key expired (and was registered again)"
        for holder in holders:
            assert holder.proc.poll() is None
            log = holder.err.read_text()
            assert "lost its lease" not in log, log[-2000:]
            late = [line for line in log.splitlines() if "after the previous refresh" in line]
            print(f"holder {holder.proc.pid}: {len(late)} late-refresh warnings", *late)
    finally:
        a._leave()
        client.close()


def test_an_etcd_that_grants_longer_leases_is_named_once_with_the_ttl_it_granted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # etcd's own defaults (election timeout 1000 ms) raise a 1 s lease to 2 s, as a
    # user's etcd given through spec.rdzvEndpoint may: detection is then slower, and says so.
    caplog.set_level("INFO", logger="elasticjob_runtime.rendezvous.handler")
    server = start_etcd("3.5", tmp_path / "etcd", fast_leases=False)
    client = EtcdClient(parse_endpoints(server.endpoint), timeout=10)
    try:
        a = EtcdV3RendezvousHandler(client, "slow-leases", Limits(1, 1, 15), "127.0.0.1")
        try:
            a.register()
            assert a.lease_ttl == 2
            a.next_rendezvous()
            time.sleep(1.0)  # several keep-alives: the line is not repeated
            lines = [r for r in caplog.records if "it granted 2s" in r.getMessage()]
            assert len(lines) == 1 and lines[0].levelname == "WARNING"
            assert f"asked etcd at {server.endpoint} for a 1s lease" in lines[0].getMessage()
        finally:
            a._leave()
    finally:
        client.close()
        server.stop()


class SlowToConnect:
    """A loopback TCP proxy to etcd that holds each new connection ``delay`` seconds before
    passing a byte: a connection whose set-up (DNS, a policy being programmed, the TLS
    handshake on a loaded node) takes that long, as a fresh pod's first one can."""

    def __init__(self, upstream: tuple[str, int], delay: float) -> None:
        self.upstream, self.delay = upstream, delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        time.sleep(self.delay)
        up = socket.create_connection(self.upstream)
        self.sockets += [conn, up]
        for src, dst in ((conn, up), (up, conn)):
            threading.Thread(target=pipe, args=(src, dst), daemon=True).start()

    def close(self) -> None:
        for s in self.sockets:
            s.close()


def test_a_node_keeps_its_first_lease_when_a_new_connection_is_slow_to_open(
    etcd_any: EtcdServer,
) -> None:
    """Every new connection takes 0.9 s to open; a refresh may take a quarter of the 1 s
    TTL. The lease keeper's connection is opened before the lease is granted, so its
    refreshes never wait for a connection and the node's first lease is its only one."""
    host, port = etcd_any.endpoint.rsplit(":", 1)
    proxy = SlowToConnect((host, int(port)), delay=0.9)
    client = EtcdClient(parse_endpoints(f"127.0.0.1:{proxy.port}"), timeout=10)
    run_id = uuid.uuid4().hex
    handler = EtcdV3RendezvousHandler(
        client, run_id, Limits(1, 2, 15), "127.0.0.1", join_timeout=90
    )
    try:
        handler.register()
        first = member_keys(client, run_id)
        assert len(first) == 1
        time.sleep(3 * handler.lease_ttl)
        assert member_keys(client, run_id) == first  # same revision, same lease
    finally:
        handler._leave()
        client.close()
        proxy.close()


def test_a_node_that_left_never_announces_itself_again(etcd: EtcdServer) -> None:
    """Leaving revokes the member lease, and the round watch or a join that then sees the
    key gone must not take a new one: the key of an agent that exited 143 came back once
    (a flaky departure test). Rejoins race the leave from another thread, as they do."""
    client = EtcdClient(parse_endpoints(etcd.endpoint), timeout=10)
    run_id = uuid.uuid4().hex
    handler = EtcdV3RendezvousHandler(client, run_id, Limits(1, 2, 15), "127.0.0.1")
    leases = handler._leases
    stop = threading.Event()

    def rejoin_until_stopped() -> None:
        while not stop.is_set():
            leases.rejoin()  # as after a lapse: a new lease unless the node left

    try:
        handler.register()
        assert len(member_keys(client, run_id)) == 1
        racer = threading.Thread(target=rejoin_until_stopped)
        racer.start()
        time.sleep(0.2)
        handler._leave()
        leases.renew_member("the round watch saw this node's member key deleted")
        stop.set()
        racer.join(timeout=30)
        assert member_keys(client, run_id) == {}
    finally:
        stop.set()
        handler._leave()
        client.close()


def test_a_stop_that_lands_while_a_node_registers_still_drops_its_key(
    etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM can land just after the member key is put, while ``register`` still runs
    (a test sent one as soon as it saw the key). The stop path (``leave_registered``,
    which ``elasticjob-run`` calls on a signal and at exit) must know the node already
    and revoke its lease: an agent that exited 143 left its key to the TTL in CI."""
    from torch.distributed.elastic.multiprocessing import SignalException

    from elasticjob_runtime.rendezvous.handler import leave_registered
    from elasticjob_runtime.rendezvous.lease_holder import LeaseHolder

    def signalled(_holder: LeaseHolder, _client: EtcdClient) -> None:
        raise SignalException("got SIGTERM", sigval=signal.SIGTERM)

    client = EtcdClient(parse_endpoints(etcd.endpoint), timeout=10)
    run_id = uuid.uuid4().hex
    handler = EtcdV3RendezvousHandler(client, run_id, Limits(1, 2, 15), "127.0.0.1")
    monkeypatch.setattr(LeaseHolder, "_start_keeper", signalled)  # the key is put by then
    try:
        with pytest.raises(SignalException):
            handler.register()
        assert len(member_keys(client, run_id)) == 1
        leave_registered()
        assert member_keys(client, run_id) == {}  # revoked, not left to its TTL
    finally:
        handler._leave()
        client.close()
