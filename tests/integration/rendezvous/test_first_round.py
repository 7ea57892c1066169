"""A run's first round waits, up to its last call, for the nodes the job asked for
(``ELASTICJOB_DESIRED_NODES``, the operator's replicas), against real etcd 3.5 and 3.6.

On kind, worker-0 of a job of 2 (minReplicas 1) sealed the first round alone while
worker-1's pod was still starting (no member key yet, so not live), and trained the
whole short job at world 1; worker-1 came to a finished run.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from conftest import EtcdServer
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from elasticjob_runtime import contract
from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.etcd.endpoints import parse_endpoints
from elasticjob_runtime.rendezvous.handler import EtcdV3RendezvousHandler
from elasticjob_runtime.rendezvous.membership import Limits

pytestmark = pytest.mark.integration

Make = Callable[[], EtcdV3RendezvousHandler]


@contextlib.contextmanager
def nodes(etcd: EtcdServer, limits: Limits) -> Iterator[Make]:
    """Make nodes of one run (each its own client), registered at once as torchrun's
    are; every one leaves and closes at the end."""
    run_id = f"first-{uuid.uuid4().hex[:8]}"
    made: list[tuple[EtcdV3RendezvousHandler, EtcdClient]] = []

    def make() -> EtcdV3RendezvousHandler:
        client = EtcdClient(parse_endpoints(etcd.endpoint), timeout=10)
        handler = EtcdV3RendezvousHandler(client, run_id, limits, "127.0.0.1", join_timeout=60)
        handler.register()
        made.append((handler, client))
        return handler

    try:
        yield make
    finally:
        for handler, client in made:
            handler._leave()
            client.close()


def joining(handler: EtcdV3RendezvousHandler) -> tuple[threading.Thread, list[RendezvousInfo]]:
    """``handler`` joining in the background; the list gets its round once it has one."""
    got: list[RendezvousInfo] = []
    thread = threading.Thread(target=lambda: got.append(handler.next_rendezvous()), daemon=True)
    thread.start()
    return thread, got


def until(check: Callable[[], bool], timeout: float = 30.0) -> float:
    """Seconds until ``check`` holds; fails after ``timeout``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if check():
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s")


def test_a_node_that_starts_after_the_first_entered_is_in_the_first_round(
    etcd_any: EtcdServer,
) -> None:
    with nodes(etcd_any, Limits(1, 2, last_call=60, desired=2)) as make:
        first = make()
        thread, got = joining(first)
        until(lambda: first._joins.entered == 1 or bool(got))
        time.sleep(2.0)  # worker-1's pod still starting: not even live
        assert not got, "the first round was sealed without the node the job asked for"
        late = make()
        info = late.next_rendezvous()
        thread.join(timeout=30)
        assert got, "the first node never joined"
        assert (got[0].world_size, info.world_size) == (2, 2)
        assert (first.round_number, late.round_number) == (1, 1)
        assert sorted((got[0].rank, info.rank)) == [0, 1]


def test_without_the_count_the_first_round_starts_with_the_live_nodes_at_once(
    etcd: EtcdServer,
) -> None:
    """The rule for a plain elasticjob-run or torchrun (no count given): what failed on
    kind, and what the count is for."""
    with nodes(etcd, Limits(1, 2, last_call=60)) as make:
        first = make()
        started = time.monotonic()
        info = first.next_rendezvous()
        assert time.monotonic() - started < 10  # not the 60 s last call
        assert (info.world_size, first.round_number) == (1, 1)


def test_the_first_round_starts_short_once_the_last_call_runs_out_and_says_so(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="elasticjob_runtime")
    with nodes(etcd, Limits(1, 2, last_call=2, desired=2)) as make:
        first = make()
        started = time.monotonic()
        info = first.next_rendezvous()
        took = time.monotonic() - started
        assert info.world_size == 1
        assert 1.8 <= took < 20, took
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("sealed the first round with 1 of the 2 nodes" in m for m in said), said


def test_a_regroup_after_a_loss_waits_for_nobody(etcd: EtcdServer) -> None:
    with nodes(etcd, Limits(1, 2, last_call=60, desired=2)) as make:
        a, b = make(), make()
        thread, got = joining(a)
        info_b = b.next_rendezvous()
        thread.join(timeout=30)
        assert got and (got[0].world_size, info_b.world_size) == (2, 2)
        b._leave()  # its pod is gone: its member key with it
        started = time.monotonic()
        again = a.next_rendezvous()
        assert time.monotonic() - started < 10  # not the 60 s last call
        assert (again.world_size, a.round_number) == (1, 2)


def test_torchruns_parameters_take_the_count_from_the_operators_variable(
    etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = RendezvousParameters(
        backend="etcd-v3",
        endpoint=etcd.endpoint,
        run_id=f"desired-{uuid.uuid4().hex[:6]}",
        min_nodes=1,
        max_nodes=3,
        local_addr="127.0.0.1",
    )
    monkeypatch.setenv(contract.DESIRED_NODES, "2")
    handler = get_rendezvous_handler(params)
    assert isinstance(handler, EtcdV3RendezvousHandler)
    try:
        assert handler._joins.limits == Limits(1, 3, last_call=15, desired=2, first_round_wait=60)
    finally:
        handler._leave()
        handler._client.close()
    monkeypatch.setenv(contract.DESIRED_NODES, "lots")
    with pytest.raises(ValueError, match=r"^ELASTICJOB_DESIRED_NODES='lots': must be a whole"):
        get_rendezvous_handler(params)
