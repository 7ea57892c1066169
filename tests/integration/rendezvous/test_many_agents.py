"""Many agents at once on one real etcd: the rounds settle into one round of everyone.

Agents are light (a handler per thread, no workers), as the scale benchmark runs them.
With the old design (every join a compare-and-set on one key, re-reading the whole
prefix on every loss) 64 agents with ``--nnodes=1:64`` and a 1 s last call never formed
a round of 64: latecomers re-opened rounds that were still being confirmed, for ever.
"""

from __future__ import annotations

import random
import threading
import time
import uuid

import pytest
from conftest import EtcdServer

from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.etcd.endpoints import parse_endpoints
from elasticjob_runtime.rendezvous.handler import EtcdV3RendezvousHandler
from elasticjob_runtime.rendezvous.membership import Limits

pytestmark = pytest.mark.integration

AGENTS = 64
# A lease long enough that 64 keep-alive threads in one process on a busy 2-core
# machine never miss one: this test is about how rounds form, not about detection.
LEASE_TTL = 3


def test_64_agents_arriving_over_two_seconds_settle_in_one_round_of_64(etcd: EtcdServer) -> None:
    run_id = f"many-{uuid.uuid4().hex[:8]}"
    limits = Limits(1, AGENTS, last_call=1.0)
    rng = random.Random(11)
    delays = sorted(rng.uniform(0, 2.0) for _ in range(AGENTS))
    clients = [EtcdClient(parse_endpoints(etcd.endpoint), timeout=30) for _ in range(AGENTS)]
    handlers = [
        EtcdV3RendezvousHandler(
            c, run_id, limits, "127.0.0.1", join_timeout=150, lease_ttl=LEASE_TTL
        )
        for c in clients
    ]
    final: dict[str, tuple[int, int]] = {}  # node -> (round, world size) once in the full round
    errors: list[BaseException] = []
    done = threading.Event()

    def agent(handler: EtcdV3RendezvousHandler, delay: float) -> None:
        try:
            time.sleep(delay)
            handler.register()
            info = handler.next_rendezvous()
            while info.world_size < AGENTS and not done.is_set():
                # as torch's agent does: restart into the next round once told to
                if handler.wait_for_membership_change(5) is not None:
                    info = handler.next_rendezvous()
            final[handler.node] = (handler.round_number, info.world_size)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=agent, args=(h, d), daemon=True)
        for h, d in zip(handlers, delays, strict=True)
    ]
    started = time.monotonic()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(1.0, 150 - (time.monotonic() - started)))
    finally:
        done.set()
        for h in handlers:
            h._leave()
        for c in clients:
            c.close()
    took = time.monotonic() - started
    assert not errors, errors[:3]
    assert len(final) == AGENTS, f"{len(final)} of {AGENTS} agents reached a full round"
    assert {w for _, w in final.values()} == {AGENTS}
    assert len({r for r, _ in final.values()}) == 1, "the agents ended in different rounds"
    assert took < 150, f"took {took:.0f}s"
