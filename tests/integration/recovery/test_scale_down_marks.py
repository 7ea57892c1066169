"""A scale-down of k workers is one regroup: the operator marks every departing node
leaving in one etcd transaction (``elasticjob_operator.etcd.leaving``, over etcd's JSON
gateway as the operator does it) before it deletes their pods, and the runtime treats a
mark as the node's own announced departure. Real etcd, real handlers and agents, real
torch workers over gloo; each agent rendezvouses from its own loopback address, as each
pod from its IP.

Before the marks, each leaving pod announced itself on its own SIGTERM, and kubelets
signal pods one after the other: a scale from 4 to 2 regrouped the survivors twice (on
kind, worlds 4, 3, 2).
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import EtcdServer, start, still_running, wait_for
from test_in_place import train_args
from torch.distributed.elastic.rendezvous import RendezvousInfo

from elasticjob_devcluster.procs import descendants
from elasticjob_operator.etcd.leaving import mark_leaving
from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.etcd.endpoints import parse_endpoints
from elasticjob_runtime.rendezvous.handler import EtcdV3RendezvousHandler
from elasticjob_runtime.rendezvous.join_executor import MarkedLeaving
from elasticjob_runtime.rendezvous.keys import leaving_prefix, state_key
from elasticjob_runtime.rendezvous.membership import Limits, Round, RoundCause

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@contextlib.contextmanager
def nodes_at(etcd: EtcdServer, run_id: str, *addrs: str) -> Iterator[list[EtcdV3RendezvousHandler]]:
    """One registered handler per address (min 1, max 4 nodes), each on its own client;
    every one leaves and closes at the end."""
    made: list[tuple[EtcdV3RendezvousHandler, EtcdClient]] = []
    try:
        for addr in addrs:
            client = EtcdClient(parse_endpoints(etcd.endpoint), timeout=10)
            handler = EtcdV3RendezvousHandler(client, run_id, Limits(1, 4, 15), addr)
            handler.register()
            made.append((handler, client))
        yield [h for h, _ in made]
    finally:
        for handler, client in made:
            handler._leave()
            client.close()


def round_key(etcd: EtcdServer, run_id: str) -> Round:
    client = EtcdClient(parse_endpoints(etcd.endpoint), timeout=10)
    try:
        kv = client.get(state_key(run_id))
    finally:
        client.close()
    assert kv is not None
    return Round.decode(kv.value)


def test_a_marked_node_in_a_round_departs_and_its_peer_regroups_without_it(
    etcd: EtcdServer,
) -> None:
    run_id = f"marks-{uuid.uuid4().hex[:8]}"
    with nodes_at(etcd, run_id, "127.0.0.1", "127.0.0.2") as (stays, goes):
        for info in _join_both(stays, goes):
            assert info.world_size == 2
        assert mark_leaving(etcd.endpoint, run_id, {"127.0.0.2"}) == [goes.node]
        wait_for("the marked node to see its mark", lambda: goes.is_leaving() or None, 30, etcd.log)
        assert goes.num_nodes_waiting() == 0  # it hands its place over; it never restarts
        assert not stays.is_leaving()
        why = stays.wait_for_membership_change(30)
        assert why == f"{goes.node} announced its departure", why
        info = stays.next_rendezvous()  # sealed at once: the marked node is not live
        assert (info.rank, info.world_size) == (0, 1)
        standing = goes.standing()
        assert standing.current is not None and standing.current.participants == (stays.node,)
        assert goes.num_nodes_waiting() == 0
        assert goes.peers_lost() == [stays.node]  # its round's group is over: it may go


def test_a_node_marked_while_it_joins_stops_as_a_sigterm_would_and_opens_no_round(
    etcd: EtcdServer,
) -> None:
    run_id = f"marks-{uuid.uuid4().hex[:8]}"
    with nodes_at(etcd, run_id, "127.0.0.1", "127.0.0.2") as (stays, goes):
        assert mark_leaving(etcd.endpoint, run_id, {"127.0.0.2"}) == [goes.node]
        info = stays.next_rendezvous()
        assert info.world_size == 1  # the marked node is not waited for
        with pytest.raises(MarkedLeaving) as raised:
            goes.next_rendezvous()  # a round with room: it would open the next one
        assert raised.value.sigval == signal.SIGTERM  # torch's launcher keeps the run open
        sealed = Round(1, (stays.node,), True, leader=stays.node, cause=RoundCause.START)
        assert round_key(etcd, run_id) == sealed
        assert stays.num_nodes_waiting() == 0  # nothing for the others to regroup for


def test_nodes_that_stopped_leave_nothing_to_mark(etcd: EtcdServer) -> None:
    run_id = f"marks-{uuid.uuid4().hex[:8]}"
    with nodes_at(etcd, run_id, "127.0.0.1") as (node,):
        node._leave()
        assert mark_leaving(etcd.endpoint, run_id, {"127.0.0.1"}) == []


def _join_both(a: EtcdV3RendezvousHandler, b: EtcdV3RendezvousHandler) -> list[RendezvousInfo]:
    infos: list[RendezvousInfo] = []
    threads = [
        threading.Thread(target=lambda h=h: infos.append(h.next_rendezvous()), daemon=True)
        for h in (a, b)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(infos) == 2, "a join did not finish"
    return infos


# -- four agents training, two marked together ----------------------------------------

ADDRS = ("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4")


def at_world(world: int, text: str) -> list[int]:
    return [int(s) for s in re.findall(rf"^step=(\d+) .*world={world} ", text, re.M)]


def since(pattern: str, text: str, t0: float) -> list[tuple[str, ...]]:
    """The groups of ``pattern`` (its last group a line's ``t=``) on lines after ``t0``."""
    return [m[:-1] for m in re.findall(pattern, text, re.M) if float(m[-1]) > t0]


def test_two_of_four_marked_together_cost_the_survivors_one_regroup_and_no_step(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    run_id = f"scale-{uuid.uuid4().hex[:8]}"
    logs = [tmp_path / f"node{i}.log" for i in range(4)]
    args = train_args(tmp_path / "ckpt", 1_000_000, "--sleep=0.05", "--epochs=1000")
    env = {"CRASH_AT_STEP": "-1", "ELASTICJOB_CHECKPOINT_MEMORY_DIR": "off"}
    procs = [
        start(
            agents, etcd, log, args, nnodes="2:4", nproc=1, run_id=run_id, env=env, local_addr=addr
        )
        for log, addr in zip(logs, ADDRS, strict=True)
    ]
    wait_for(
        "training at world size 4",
        lambda: True if len(at_world(4, logs[0].read_text())) >= 20 else None,
        300,
        logs[0],
    )
    survivors, leavers = (0, 1), (2, 3)
    families = {i: descendants(procs[i].pid) for i in leavers}
    marked_at = time.time()
    marked = mark_leaving(etcd.endpoint, run_id, {ADDRS[i] for i in leavers})
    assert sorted(n.split("_")[0] for n in marked) == ["127.0.0.3", "127.0.0.4"], marked
    # the operator deletes the pods next: one kubelet's SIGTERM comes while the node hands
    # over; the other node goes by its mark alone
    time.sleep(0.5)
    procs[2].send_signal(signal.SIGTERM)
    for i in leavers:
        wait_for("a marked agent to exit", lambda i=i: procs[i].poll(), 90, logs[i])
        assert procs[i].returncode == 143, logs[i].read_text()[-3000:]
        assert not still_running(families[i]), still_running(families[i])
        left = logs[i].read_text()
        assert "departure: the workers have left; exiting" in left, left[-3000:]
    assert "marked leaving (a scale-down); it hands over" in logs[3].read_text()
    for i in survivors:
        wait_for(
            "the survivors training at world size 2",
            lambda i=i: True if len(at_world(2, logs[i].read_text())) >= 10 else None,
            90,
            logs[i],
        )
    last_together = max(max(at_world(4, log.read_text())) for log in logs)
    # the survivors heard of both leaving nodes in one watch event
    both = r"restarts its workers: \S+, \S+ announced its departure"
    assert any(re.search(both, logs[i].read_text()) for i in survivors)
    for i in survivors:
        text = logs[i].read_text()
        # one regroup after the marks, to world 2, at the last step the 4 trained together
        regroups = since(r"^regrouped at step (\d+) .*world=(\d+) .*t=([\d.]+)", text, marked_at)
        assert regroups == [(str(last_together), "2")], (regroups, last_together, text[-3000:])
        trained = since(r"^step=(\d+) .*world=(\d+) .*pid=(\d+) t=([\d.]+)", text, marked_at)
        assert {world for _, world, _ in trained} <= {"4", "2"}, "a round of 3 after the marks"
        assert len({pid for _, _, pid in trained}) == 1, "the survivor's worker restarted"
        steps = [int(step) for step, _, _ in trained]
        assert steps == sorted(set(steps)), "a step was trained twice"
        assert "abandoning the round's collectives" not in text, text[-3000:]
        assert not re.search(r"step \d+ dropped", text), text[-3000:]
    client = EtcdClient(parse_endpoints(etcd.endpoint), timeout=10)
    try:  # the marks went with the nodes' leases
        assert not client.snapshot(leaving_prefix(run_id)).items
    finally:
        client.close()
