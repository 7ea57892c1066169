"""The etcd-v3 handler in-process against real etcd 3.5 and 3.6: rounds, lost peers, close."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import pytest
from conftest import EtcdServer, cut_off_keepers, start_etcd
from tcp_faults import TcpFaultProxy
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from elasticjob_runtime import contract
from elasticjob_runtime.etcd.client import EtcdClient, EtcdError
from elasticjob_runtime.etcd.endpoints import parse_endpoints
from elasticjob_runtime.rendezvous.backend import EtcdV3RendezvousBackend
from elasticjob_runtime.rendezvous.etcd_store import RoundAbandoned
from elasticjob_runtime.rendezvous.handler import EtcdV3RendezvousHandler
from elasticjob_runtime.rendezvous.join import RunFinishedError
from elasticjob_runtime.rendezvous.keys import members_prefix, state_key
from elasticjob_runtime.rendezvous.leases import LAPSES_BEFORE_LEAVING
from elasticjob_runtime.rendezvous.membership import Limits, Round, encode_participants

pytestmark = pytest.mark.integration


T = TypeVar("T")
Factory = Callable[..., tuple[EtcdV3RendezvousHandler, EtcdClient]]


@contextlib.contextmanager
def handler_factory(endpoint: str, run_id: str, timeout: float = 10) -> Iterator[Factory]:
    """Make handlers (each with its own client) on one etcd, registered at once as
    handler_from_params makes torchrun's; every one leaves and closes at the end."""
    made: list[tuple[EtcdV3RendezvousHandler, EtcdClient]] = []

    def make(
        lo: int = 1, hi: int = 3, join_timeout: float = 60.0
    ) -> tuple[EtcdV3RendezvousHandler, EtcdClient]:
        client = EtcdClient(parse_endpoints(endpoint), timeout=timeout)
        handler = EtcdV3RendezvousHandler(
            client, run_id, Limits(lo, hi, last_call=15), "127.0.0.1", join_timeout=join_timeout
        )
        handler.register()
        made.append((handler, client))
        return handler, client

    try:
        yield make
    finally:
        for handler, client in made:
            handler._leave()
            client.close()


@pytest.fixture
def handlers(etcd_any: EtcdServer) -> Iterator[Factory]:
    with handler_factory(etcd_any.endpoint, f"handler-{uuid.uuid4().hex[:8]}") as make:
        yield make


def in_threads(
    calls: Sequence[Callable[[], T]], timeout: float = 120
) -> tuple[list[T | None], list[BaseException]]:
    """Run ``calls`` at once, each in its own thread; their results (None if unfinished)
    and whatever they raised."""
    results: list[T | None] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return results, errors


def join_all(*handlers: EtcdV3RendezvousHandler) -> list[RendezvousInfo]:
    results, errors = in_threads([h.next_rendezvous for h in handlers])
    assert not errors, errors
    finished = [info for info in results if info is not None]
    assert len(finished) == len(handlers), "a join did not finish"
    return finished


def join_in_background(
    handler: EtcdV3RendezvousHandler,
) -> tuple[threading.Thread, list[RendezvousInfo]]:
    """Start ``handler`` joining; the list gets its result once it has one."""
    result: list[RendezvousInfo] = []
    thread = threading.Thread(target=lambda: result.append(handler.next_rendezvous()), daemon=True)
    thread.start()
    return thread, result


def seal_round(client: EtcdClient, *nodes: EtcdV3RendezvousHandler) -> None:
    """Write round 1, sealed with ``nodes`` in rank order, as if one of them had."""
    sealed = Round(number=1, participants=tuple(n.node for n in nodes), complete=True)
    backend = EtcdV3RendezvousBackend(client, nodes[0].get_run_id())
    assert backend.set_state(sealed.encode()) is not None


def round_number(client: EtcdClient, run_id: str) -> int | None:
    kv = client.get(state_key(run_id))
    return None if kv is None else Round.decode(kv.value).number


def wait_until(check: Callable[[], bool], timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if check():
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s")


def test_nodes_meet_at_once_when_all_live_nodes_have_joined(handlers: Factory) -> None:
    a, _ = handlers()
    b, _ = handlers()
    started = time.monotonic()
    infos = join_all(a, b)
    # min 1, max 3: torch's dynamic handler would sit out a 30 s last call here.
    assert time.monotonic() - started < 10
    assert sorted(i.rank for i in infos) == [0, 1]
    assert {i.world_size for i in infos} == {2}
    assert (
        len(
            {
                (i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port)
                for i in infos
            }
        )
        == 1
    )


def test_three_nodes_arriving_together_always_end_up_in_one_round_of_three(
    etcd: EtcdServer,
) -> None:
    # min 2, max 3: the first two can seal a round before the third registers, which
    # then opens the next one. Repeated because the interleavings differ every time;
    # once in about 40 joins an agent used to wait for ever in an abandoned round.
    rng = random.Random(7)
    for attempt in range(100):
        delays = [rng.uniform(0, 0.05) for _ in range(3)]
        sizes, errors = three_arrive_together(
            etcd, f"crowd-{attempt}-{uuid.uuid4().hex[:6]}", delays
        )
        assert not errors, f"attempt {attempt}: {errors}"
        assert sizes == [3, 3, 3], f"attempt {attempt}: {sizes}"


def three_arrive_together(
    etcd: EtcdServer, run_id: str, delays: list[float]
) -> tuple[list[int | None], list[BaseException]]:
    """Three nodes (min 2, max 3) start after ``delays`` and rejoin until all three meet;
    returns each one's final world size."""
    clients = [EtcdClient(parse_endpoints(etcd.endpoint), timeout=10) for _ in delays]
    made: list[EtcdV3RendezvousHandler] = []

    def node(client: EtcdClient, delay: float) -> int:
        time.sleep(delay)
        handler = EtcdV3RendezvousHandler(
            client, run_id, Limits(2, 3, last_call=15), "127.0.0.1", join_timeout=60
        )
        made.append(handler)
        info = handler.next_rendezvous()
        while info.world_size < 3:
            if handler.wait_for_membership_change(30) is None:
                raise AssertionError(f"stuck at world size {info.world_size}")
            info = handler.next_rendezvous()
        return info.world_size

    try:
        return in_threads(
            [functools.partial(node, c, d) for c, d in zip(clients, delays, strict=True)]
        )
    finally:
        for handler in made:
            handler._leave()
        for client in clients:
            client.close()


def test_a_crashed_peer_is_reported_within_the_lease_ttl_and_the_next_round_excludes_it(
    handlers: Factory,
) -> None:
    a, _ = handlers()
    b, _ = handlers()
    join_all(a, b)
    assert a.num_nodes_waiting() == 0

    b._stop.set()  # b's process "dies": no more keep-alives, nothing revoked
    took = wait_until(lambda: a.num_nodes_waiting() > 0, 15)
    assert took < 6, f"lost peer noticed after {took:.1f}s"

    (info,) = join_all(a)
    assert (info.rank, info.world_size) == (0, 1)


def test_a_round_sealed_with_a_node_binds_it_even_once_a_newer_round_has_opened(
    handlers: Factory,
) -> None:
    # a and b entered round 1 and a sealed it with both; c opened round 2 before either
    # read the round key again. Both must still run round 1 together (neither may wait
    # for the other in it alone), then restart into round 2 at once.
    a, client = handlers()
    b, _ = handlers()
    c, _ = handlers()
    run = a.get_run_id()
    backend = EtcdV3RendezvousBackend(client, run)
    assert backend.set_state(Round(1, leader=a.node).encode()) is not None
    a._enter(1)
    b._enter(1)
    sealed = Round(1, (a.node, b.node), complete=True, leader=a.node)
    kv = client.get(state_key(run))
    assert kv is not None
    sealed_record = contract.run_prefix(run) + f"rounds/{1:010d}/sealed"
    ok, kv = client.compare_and_set(
        state_key(run),
        sealed.encode(),
        kv.mod_revision,
        also={sealed_record: encode_participants(sealed.participants)},
    )
    assert ok and kv is not None
    ok, _ = client.compare_and_set(
        state_key(run), Round(2, leader=c.node).encode(), kv.mod_revision
    )
    assert ok

    infos = join_all(a, b)
    assert sorted((i.rank, i.world_size) for i in infos) == [(0, 2), (1, 2)]
    assert a.round_number == b.round_number == 1
    assert a.num_nodes_waiting() > 0 and b.num_nodes_waiting() > 0


def test_a_peer_lost_before_it_published_its_address_breaks_the_round_up(
    handlers: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    # a (rank 0) was sealed in and died before writing the master address: b gives up on
    # the round once a's lease is gone, not after the store's 300 s timeout.
    caplog.set_level("INFO", logger="elasticjob_runtime.rendezvous.handler")
    a, client = handlers(lo=1, hi=2)
    b, _ = handlers(lo=1, hi=2)
    seal_round(client, a, b)
    b_joins, result = join_in_background(b)
    time.sleep(1.5)  # b is now waiting for a's address in round 1's store
    a._leave()
    b_joins.join(timeout=60)
    assert result, "b never finished joining"
    assert (result[0].rank, result[0].world_size) == (0, 1)
    assert "round 1 broke up" in caplog.text


def test_old_rounds_keys_are_dropped(handlers: Factory) -> None:
    a, client = handlers(lo=1, hi=1)
    for _ in range(4):
        (info,) = join_all(a)
        info.store.set("k", b"v")
    rounds = {
        key.split("/store/")[1].split("/")[0]
        for key in client.snapshot(contract.run_prefix(a.get_run_id())).items
        if "/store/" in key
    }
    assert len(rounds) <= 2, rounds


def test_a_closed_rendezvous_turns_away_newcomers_with_a_clear_error(handlers: Factory) -> None:
    a, _ = handlers()
    join_all(a)
    assert a.shutdown() and a.is_closed()  # as when a's agent ran out of restarts
    late, _ = handlers()
    with pytest.raises(RendezvousClosedError, match="without finishing") as raised:
        late.next_rendezvous()
    assert not isinstance(raised.value, RunFinishedError)


def test_a_newcomer_to_a_run_that_finished_training_is_told_nothing_is_left(
    handlers: Factory,
) -> None:
    a, _ = handlers()
    join_all(a)
    a.mark_finished()
    assert a.shutdown() and a.is_closed()
    late, _ = handlers()
    with pytest.raises(RunFinishedError, match="finished training before this node joined"):
        late.next_rendezvous()


def test_a_round_below_min_nodes_times_out_saying_what_is_missing(handlers: Factory) -> None:
    a, _ = handlers(lo=2, hi=2, join_timeout=2)
    with pytest.raises(RendezvousTimeoutError, match="1 of at least 2 nodes have joined"):
        a.next_rendezvous()


def test_torch_registry_builds_the_handler_from_torchrun_parameters(etcd: EtcdServer) -> None:
    params = RendezvousParameters(
        backend="etcd-v3",
        endpoint=etcd.endpoint,
        run_id=f"registry-{uuid.uuid4().hex[:6]}",
        min_nodes=1,
        max_nodes=2,
        local_addr="127.0.0.1",
        lease_ttl="3",
    )
    handler = get_rendezvous_handler(params)
    assert isinstance(handler, EtcdV3RendezvousHandler)
    assert handler.get_backend() == "etcd-v3" and not handler.use_agent_store
    # live before it joins: a first round waits for a node whose agent still warms up
    assert handler.node in live_nodes(etcd, params.run_id)
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    assert handler.shutdown()


def live_nodes(etcd: EtcdServer, run_id: str) -> list[str]:
    client = EtcdClient(parse_endpoints(etcd.endpoint), timeout=10)
    try:
        keys = client.snapshot(members_prefix(run_id)).items
    finally:
        client.close()
    return sorted(key.removeprefix(members_prefix(run_id)) for key in keys)


def keepers(handler: EtcdV3RendezvousHandler) -> int:
    return sum(t.name == f"etcd-v3-lease-{handler.node}" for t in threading.enumerate())


def test_building_a_handler_touches_nothing_until_it_registers(etcd: EtcdServer) -> None:
    run_id = f"inert-{uuid.uuid4().hex[:6]}"
    client = EtcdClient(parse_endpoints(etcd.endpoint), timeout=10)
    handler = EtcdV3RendezvousHandler(client, run_id, Limits(1, 1, 15), "127.0.0.1")
    try:
        assert client.snapshot(contract.run_prefix(run_id)).items == {}  # no key, no lease
        assert keepers(handler) == 0 and handler.lease_ttl == 0
        handler.register()
        handler.register()  # once only
        assert live_nodes(etcd, run_id) == [handler.node]
        assert keepers(handler) == 1 and handler.lease_ttl == 1
    finally:
        handler._leave()
        client.close()
    wait_until(lambda: keepers(handler) == 0, 10)  # the keeper ends with the handler's leave
    assert live_nodes(etcd, run_id) == []


def test_membership_is_still_watched_after_etcd_restarts(tmp_path: Path) -> None:
    server = start_etcd("3.5", tmp_path / "etcd")
    try:
        with handler_factory(server.endpoint, "restarts", timeout=10) as make:
            made = [make(1, 3) for _ in range(2)]
            (a, _), (b, _) = made
            join_all(a, b)

            server.restart()
            time.sleep(1.0)
            assert a.num_nodes_waiting() == 0  # nothing changed; a notices its watch is gone

            b._leave()
            took = wait_until(lambda: a.num_nodes_waiting() > 0, 15)
            assert took < 10
    finally:
        server.stop()


def test_a_watch_refused_right_after_a_restart_is_tried_again(tmp_path: Path) -> None:
    """gRPC can refuse a new watch stream just after etcd is back while reads already
    work (seen in CI): the handler must keep trying, not believe it is watching."""
    server = start_etcd("3.5", tmp_path / "etcd")
    try:
        with handler_factory(server.endpoint, "refused", timeout=10) as make:
            made = [make(1, 3) for _ in range(2)]
            (a, a_client), (b, _) = made
            join_all(a, b)

            watch_prefix = a_client.watch_prefix
            refusals: list[str] = []

            def refuse_once(*args, **kwargs):  # type: ignore[no-untyped-def]
                if not refusals:
                    refusals.append("refused")
                    raise EtcdError("watch refused (UNAVAILABLE), as gRPC does after a restart")
                return watch_prefix(*args, **kwargs)

            a_client.watch_prefix = refuse_once  # type: ignore[method-assign]
            server.restart()
            wait_until(lambda: a.num_nodes_waiting() == 0 and bool(refusals), 15)
            assert a.num_nodes_waiting() == 0  # the check after the refusal, with nothing changed

            b._leave()
            took = wait_until(lambda: a.num_nodes_waiting() > 0, 15)
            assert took < 10
    finally:
        server.stop()


def test_a_join_rides_out_an_etcd_restart(tmp_path: Path) -> None:
    server = start_etcd("3.5", tmp_path / "etcd")
    try:
        with handler_factory(server.endpoint, "rides", timeout=5) as make:
            made = [make(2, 2) for _ in range(2)]
            (a, _), (b, _) = made
            waiting, joined = join_in_background(a)
            time.sleep(1.0)  # a is waiting for a second node when etcd goes down
            server.restart()
            (info_b,) = join_all(b)
            waiting.join(timeout=60)
            assert joined, "the waiting node never completed its join"
            assert {joined[0].rank, info_b.rank} == {0, 1}
            assert joined[0].world_size == info_b.world_size == 2
    finally:
        server.stop()


def test_registering_rides_out_an_etcd_that_does_not_answer_for_a_moment(
    tmp_path: Path,
) -> None:
    """An etcd starved of CPU fails a grant or a put ("request timed out") that it applies
    a moment later: the 1,024-agent bench round lost an agent, and so the round, to one
    such answer while the agent registered. It is tried again within the join timeout."""
    server = start_etcd("3.5", tmp_path / "etcd")
    run_id = f"frozen-{uuid.uuid4().hex[:6]}"
    client = EtcdClient(parse_endpoints(server.endpoint), timeout=1)
    handler = EtcdV3RendezvousHandler(
        client, run_id, Limits(1, 1, 15), "127.0.0.1", join_timeout=30
    )
    failed: list[BaseException] = []

    def register() -> None:
        try:
            handler.register()
        except BaseException as exc:  # the test looks at it
            failed.append(exc)

    try:
        os.kill(server.proc.pid, signal.SIGSTOP)
        registering = threading.Thread(target=register)
        registering.start()
        time.sleep(2.5)  # two of its requests have timed out by now
        os.kill(server.proc.pid, signal.SIGCONT)
        registering.join(timeout=30)
        assert not registering.is_alive(), "registering went on past its join timeout"
        assert failed == []
        assert live_nodes(server, run_id) == [handler.node]
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        handler._leave()
        client.close()
        server.stop()


def test_nodes_meet_again_on_an_etcd_that_lost_its_data(tmp_path: Path) -> None:
    """A job's etcd pod replaced on an empty volume: the leases the nodes hold are gone,
    so they must take new ones instead of failing every write with "lease not found"."""
    server = start_etcd("3.5", tmp_path / "etcd")
    try:
        with handler_factory(server.endpoint, "wiped", timeout=5) as make:
            made = [make(2, 2, join_timeout=60) for _ in range(2)]
            (a, _), (b, _) = made
            join_all(a, b)

            server.stop()
            shutil.rmtree(tmp_path / "etcd" / "data")
            server.restart()
            infos = join_all(a, b)
            assert sorted(i.rank for i in infos) == [0, 1]
            assert all(i.world_size == 2 for i in infos)
    finally:
        server.stop()


def test_a_join_takes_a_new_lease_when_etcd_no_longer_knows_its_own(
    handlers: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's lease gone behind a node's back (a new etcd pod, its keeper cut off): its
    next write fails with "lease not found", and it must take a new lease at once rather
    than retry the same write until its join times out (seen in the e2e etcd-loss test)."""
    # no keeper help
    monkeypatch.setattr("elasticjob_runtime.rendezvous.leases.JOB_LEASE_REFRESH_S", 1e9)
    a, client = handlers(lo=1, hi=1, join_timeout=30)
    join_all(a)
    client.revoke(a._leases.job_lease)  # its round key goes with it: the next join must open one
    started = time.monotonic()
    (info,) = join_all(a)
    assert info.world_size == 1
    assert time.monotonic() - started < 20


def test_nodes_whose_keepers_were_cut_off_with_a_lost_etcd_stay_members(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd replaced by an empty one while the nodes' keepers stay cut off, then a third
    node joins: the round of three must hold. Before the fix each join took new leases
    that nothing kept alive, so a TTL later the node's member key lapsed and every round
    with it broke (its peers and the node itself named it a lost peer)."""
    cut, release = cut_off_keepers(monkeypatch)
    server = start_etcd("3.5", tmp_path / "etcd")
    try:
        with handler_factory(server.endpoint, "cut-keepers", timeout=5) as make:
            (a, _), (b, _) = make(2, 3), make(2, 3)
            join_all(a, b)

            cut.set()
            server.stop()
            shutil.rmtree(tmp_path / "etcd" / "data")
            server.restart()
            # as torch's loop does: the watch says the round is gone; both join again
            assert wait_until(lambda: a.num_nodes_waiting() > 0, 15) is not None
            assert wait_until(lambda: b.num_nodes_waiting() > 0, 15) is not None
            join_all(a, b)

            c, _ = make(2, 3)  # a new node, its keeper on a connection to the new etcd
            waiting, joined_c = join_in_background(c)
            assert wait_until(lambda: a.num_nodes_waiting() > 0, 15) is not None
            assert wait_until(lambda: b.num_nodes_waiting() > 0, 15) is not None
            infos = join_all(a, b)
            waiting.join(timeout=60)
            assert joined_c, "the third node never joined"
            assert [i.world_size for i in [*infos, *joined_c]] == [3, 3, 3]

            # it holds for several TTLs (torch's loop asks every monitor interval)
            deadline = time.monotonic() + 6
            while time.monotonic() < deadline:
                for node in (a, b, c):
                    assert node.num_nodes_waiting() == 0, (node.node, node._watch.restart_why)
                time.sleep(0.1)
    finally:
        release.set()
        server.stop()


@pytest.mark.parametrize("how", ["it died", "it went on to the next round"])
def test_rank_assignment_gives_up_when_a_participant_left_the_sealed_round(
    handlers: Factory, how: str
) -> None:
    """torch's agent assigns ranks in the round's store (``_assign_worker_ranks``): rank 0
    waits for every participant's role, the others for rank 0's answer. A participant
    that left the sealed round before writing its role (its round broke up: the e2e
    etcd-loss test's new node, which abandoned the round when rank 0's lease lapsed) never
    comes; the others waited the store's 300 s, silent, while it trained alone."""
    made = [handlers(lo=3, hi=3) for _ in range(3)]
    nodes = [h for h, _ in made]
    infos = join_all(*nodes)
    by_rank = {info.rank: (node, info) for node, info in zip(nodes, infos, strict=True)}
    leaver = by_rank[2][0]
    moved_on: tuple[threading.Thread, list[RendezvousInfo]] | None = None
    if how == "it died":
        leaver._leave()
    else:
        moved_on = join_in_background(leaver)  # it opens the next round "after a local failure"
    store0, store1 = by_rank[0][1].store, by_rank[1][1].store
    store0.set("torchelastic/role_info/0", b"0")
    store1.set("torchelastic/role_info/1", b"1")
    started = time.monotonic()
    results, errors = in_threads(
        [
            lambda: store0.multi_get([f"torchelastic/role_info/{i}" for i in range(3)]),
            lambda: store1.get("torchelastic/assigned_ranks/1"),
        ],
        timeout=30,
    )
    assert len(errors) == 2, f"still waiting after 30 s: {results}"
    assert all(isinstance(e, RoundAbandoned) for e in errors), errors
    assert time.monotonic() - started < 10
    if moved_on is not None:  # the three meet again in the next round, as their agents do
        infos = join_all(by_rank[0][0], by_rank[1][0])
        moved_on[0].join(timeout=60)
        assert moved_on[1], "the node that moved on never joined the next round"
        assert [i.world_size for i in [*infos, *moved_on[1]]] == [3, 3, 3]


def in_threads_later(
    calls: Sequence[Callable[[], T]], timeout: float = 120
) -> Callable[[], tuple[list[T | None], list[BaseException]]]:
    """:func:`in_threads`, started now; call what it returns to wait for them."""
    done: list[tuple[list[T | None], list[BaseException]]] = []
    runner = threading.Thread(target=lambda: done.append(in_threads(calls, timeout)), daemon=True)
    runner.start()

    def wait() -> tuple[list[T | None], list[BaseException]]:
        runner.join(timeout + 5)
        return done[0]

    return wait


def follow_rounds(node: EtcdV3RendezvousHandler, until: float) -> None:
    """What torch's agent does with a handler until ``until``: ask every monitor interval
    whether peers came or went, and join the next round when they did."""
    while time.monotonic() < until:
        if node.num_nodes_waiting() > 0:
            node.next_rendezvous()
        time.sleep(0.1)


def count_member_losses(client: EtcdClient, run_id: str, node: str) -> Callable[[], int]:
    """Start counting how often ``node``'s member key is deleted; the count so far."""
    losses: list[str] = []
    key = members_prefix(run_id) + node
    revision = client.snapshot(members_prefix(run_id)).revision
    client.watch_prefix(
        members_prefix(run_id),
        revision + 1,
        lambda: None,
        on_keys=lambda changes: losses.extend(c.key for c in changes if c.deleted and c.key == key),
    )
    return lambda: len(losses)


@contextlib.contextmanager
def direct_and_proxied(
    etcd: EtcdServer, run_id: str
) -> Iterator[tuple[TcpFaultProxy, Factory, Factory]]:
    """Two factories of nodes of one run: the first's reach ``etcd`` directly, the
    second's through a :class:`TcpFaultProxy` (also yielded) that the test faults."""
    host, port = etcd.endpoint.removeprefix("http://").rsplit(":", 1)
    with (
        TcpFaultProxy(host, int(port)) as proxy,
        handler_factory(etcd.endpoint, run_id, timeout=5) as direct,
        handler_factory(f"http://127.0.0.1:{proxy.port}", run_id, timeout=5) as proxied,
    ):
        yield proxy, direct, proxied


def test_a_node_whose_keeper_connection_stalls_while_new_ones_hang_keeps_its_place(
    etcd: EtcdServer,
) -> None:
    """Issue 34, seen on kind during a scale-up: a node's lease keeper got no answer on
    its connection while the node's main one worked, and every new connection from its
    pod to etcd took seconds. The keeper was replaced by one on a new connection that
    waited for it, so each new member lease lapsed too, and every TTL and a half the whole
    job regrouped, for five minutes. Here the node's traffic passes a real TCP proxy: the
    keeper's connection stalls for three TTLs and no new connection ever reaches etcd. The
    node keeps its lease over its main connection: no regroup at all."""
    run_id = f"slow-connect-{uuid.uuid4().hex[:8]}"
    with direct_and_proxied(etcd, run_id) as (proxy, direct, proxied):
        a, client = direct(2, 2, join_timeout=30)
        b, _ = proxied(2, 2, join_timeout=30)
        join_all(a, b)
        # register() opens the keeper's connection before the main one's first request
        assert proxy.accepted == 2
        losses = count_member_losses(client, run_id, b.node)
        proxy.hold_new = 3600.0  # from now on no new connection of b's reaches etcd
        until = time.monotonic() + 12
        followers = in_threads_later([functools.partial(follow_rounds, n, until) for n in (a, b)])
        proxy.stall(3.0, connections=frozenset({0}))
        _, errors = followers()
        assert not errors, errors
        assert losses() == 0, f"b's member key lapsed {losses()} times; each regrouped the job"
        assert (
            sorted(a._watch.participants)
            == sorted(b._watch.participants)
            == sorted([a.node, b.node])
        )


def test_a_node_that_keeps_losing_its_lease_leaves_the_job_with_one_line(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A node whose lease keeps lapsing (four times within a minute) stops announcing
    itself (each lapse regroups every peer): its next join fails with one line that says
    why, and its peers train on without it."""
    run_id = f"flapping-{uuid.uuid4().hex[:8]}"
    with direct_and_proxied(etcd, run_id) as (proxy, direct, proxied):
        a, _ = direct(1, 2, join_timeout=30)
        b, _ = proxied(1, 2, join_timeout=30)
        join_all(a, b)
        for _ in range(LAPSES_BEFORE_LEAVING - 1):
            proxy.stall(2.0)  # longer than its lease: it lapses, and b comes back
            assert wait_until(lambda: a.num_nodes_waiting() > 0, 10) is not None
            assert wait_until(lambda: a._state.is_live(b.node), 10) is not None
            assert [i.world_size for i in join_all(a, b)] == [2, 2]
        proxy.stall(2.0)  # once more within a minute: b leaves
        with pytest.raises(
            RendezvousConnectionError, match=f"lost its member lease {LAPSES_BEFORE_LEAVING} times"
        ):
            b.next_rendezvous()
        # torch's launcher shuts the rendezvous down when its agent fails: not the run
        assert not b.shutdown()
        assert wait_until(lambda: a.num_nodes_waiting() > 0, 10) is not None
        (info,) = join_all(a)
        assert info.world_size == 1
        said = [r for r in caplog.records if "lost its member lease" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]
