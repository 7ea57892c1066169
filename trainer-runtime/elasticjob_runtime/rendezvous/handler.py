"""The ``etcd-v3`` rendezvous: torch elastic's handler interface on etcd's v3 API.

:class:`EtcdV3RendezvousHandler`, which the ``etcd-v3`` name resolves to, is a facade
over small parts, split the way torch splits its dynamic handler:

* :mod:`~elasticjob_runtime.rendezvous.membership`: every rule, pure;
* :mod:`~elasticjob_runtime.rendezvous.join` and
  :mod:`~elasticjob_runtime.rendezvous.join_executor`: the join loop that ``match``es on the rules'
  decisions, and the executor that carries each one out;
* :mod:`~elasticjob_runtime.rendezvous.state`: the reads, and the round key's writes
  through :mod:`~elasticjob_runtime.rendezvous.backend` (torch's ``RendezvousBackend``
  contract, so it also plugs into torch's ``DynamicRendezvousHandler``);
* :mod:`~elasticjob_runtime.rendezvous.lease_holder`: the leases and their keeper thread;
* :mod:`~elasticjob_runtime.rendezvous.round_watch`: the running round and its watch;
* :mod:`~elasticjob_runtime.rendezvous.keys`: every key.

Membership comes from etcd leases: every agent keeps a member key alive under its own
short lease and watches the run's prefix. A peer that dies loses its key within the lease
TTL; a newcomer opens a new round; either way the watch fires and
``num_nodes_waiting()`` tells the agent to restart its workers into the next round at
once. torch's dynamic handler instead waits out heartbeats (15 s by default), a 30 s last
call and, for a peer that died silently, the collective timeout (pytorch#111646).

The lease TTL (``lease_ttl``, 1 s by default) is how long a dead or frozen node goes
unnoticed; :mod:`elasticjob_runtime.rendezvous.leases` has the rules and etcd's limits on it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import replace

# The .api submodule, not the package: torch loads this entry point while the
# package itself is still initialising.
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

from elasticjob_runtime import contract
from elasticjob_runtime.etcd.client import EtcdClient, EtcdError
from elasticjob_runtime.etcd.tls import connect
from elasticjob_runtime.rendezvous.backend import BACKEND_NAME
from elasticjob_runtime.rendezvous.departure import Standing
from elasticjob_runtime.rendezvous.etcd_store import EtcdV3Store, RoundAbandoned
from elasticjob_runtime.rendezvous.join import join_round
from elasticjob_runtime.rendezvous.join_executor import JoinExecutor
from elasticjob_runtime.rendezvous.keys import RendezvousKeys
from elasticjob_runtime.rendezvous.lease_holder import LeaseHolder, MembershipGivenUp
from elasticjob_runtime.rendezvous.leases import DEFAULT_LEASE_TTL
from elasticjob_runtime.rendezvous.membership import Joined, Limits, Round, desired_nodes
from elasticjob_runtime.rendezvous.peer_watch import PeerWatch
from elasticjob_runtime.rendezvous.round_watch import RoundWatch
from elasticjob_runtime.rendezvous.state import RendezvousState

__all__ = ["EtcdV3RendezvousHandler", "handler_from_params"]

log = logging.getLogger(__name__)


class EtcdV3RendezvousHandler(RendezvousHandler):
    """Lease-and-watch rendezvous; see the module docstring for why."""

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        limits: Limits,
        local_addr: str | None = None,
        join_timeout: float = 600.0,
        lease_ttl: int = DEFAULT_LEASE_TTL,
        job_ttl: int = 3600,
        watch_peers: bool = True,
    ) -> None:
        if limits.min_nodes < 1 or limits.max_nodes < limits.min_nodes:
            raise ValueError(
                f"bad node range {limits.min_nodes}:{limits.max_nodes}; use MIN:MAX with "
                "1 <= MIN <= MAX"
            )
        self._client = client
        self._run_id = run_id
        self._join_timeout = join_timeout
        self._addr = local_addr or os.environ.get(contract.POD_IP) or socket.getfqdn()
        self.node = f"{self._addr}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self._state = RendezvousState(client, RendezvousKeys(run_id))
        # Leases, the member key and the keeper thread come with register(), not here:
        # building a handler touches nothing.
        self._leases = LeaseHolder(
            client,
            self._state.keys,
            self.node,
            self._addr,
            lease_ttl,
            job_ttl,
            on_job_lease=self._state.use_lease,
        )
        self._stop = self._leases.stop  # set: this node left
        self._registered = False
        self._register_lock = threading.Lock()
        self._joins = JoinExecutor(self._state, self._leases, self.node, limits, join_timeout)
        self._watch = RoundWatch(self._state, self.node, on_own_loss=self._own_lease_lapsed)
        # asks the next node of the round for an answer: a frozen one is dropped after a
        # TTL of silence, not when etcd's lessor next looks (peer_watch.py)
        # (``watch_peers=False``: many light agents packed in one process, as the scale
        # benchmark runs them, where a thread each asking ten times a second measures
        # the packing, not the rendezvous)
        self._peers = PeerWatch(
            self.node, self._state.member, client.revoke, lambda: self._leases.granted_ttl
        )
        self._watch_peers = watch_peers
        self._finished = False  # training finished here: the close says so (mark_finished)
        # Why the next round this node opens is opened, where the agent knows (a hang);
        # else the round watch's reason, else membership's rule (RoundCause).
        self.next_cause: str | None = None
        self.round_cause = ""  # the cause of the round last joined ("": not known)

    def register(self) -> None:
        """Take part in the run: the run's lease, this node's member lease and key, and a
        thread keeping both alive. Once; later calls do nothing. A busy etcd's failed
        requests are tried again for up to the join timeout, as a join's are.

        :func:`handler_from_params` calls it at once, so a node counts as live (a first
        round waits for it) while its agent still warms up; the first
        :meth:`next_rendezvous` calls it for a handler built directly.
        """
        with self._register_lock:
            if self._registered:
                return
            # Known before the member key exists: a stop (SIGTERM) that lands while
            # start() still runs must find this node and drop the key it just put.
            _REGISTERED.add(self)
            self._leases.start(time.monotonic() + self._join_timeout)
            self._registered = True

    def _enter(self, number: int) -> None:
        """Put this node's join key for round ``number`` (tests stage rounds with it)."""
        self._joins.enter(number)

    def _leave(self) -> None:
        """Drop the member key now so peers learn at once, not after the lease TTL."""
        self._stop.set()
        self._watch.stop()
        self._peers.stop()
        self._leases.leave()

    # -- RendezvousHandler --------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        # Workers start their own TCPStore on rank 0 each round; a store shared with
        # the agent broke scale-up with torch 2.13 (see docs/design.md).
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            self.register()
        except EtcdError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        self._joins.cause = self.next_cause or self._watch.restart_cause
        self.next_cause = None
        self._watch.leave_round()
        self._peers.follow(())
        deadline = time.monotonic() + self._join_timeout
        while True:
            try:
                if self._leases.given_up is not None:
                    raise MembershipGivenUp(self._leases.given_up)
                joined, sealed_at = join_round(self._joins, self._watch.round, deadline)
            except MembershipGivenUp as exc:
                raise RendezvousConnectionError(str(exc)) from exc
            try:
                store, bootstrap = self._start(joined, sealed_at)
            except RoundAbandoned as exc:
                log.info("etcd-v3: %s: round %d broke up: %s", self.node, joined.number, exc)
                self._peers.follow(())
                continue
            except EtcdError as exc:
                raise RendezvousConnectionError(str(exc)) from exc
            log.info(
                "etcd-v3: %s joined round %d as rank %d of %d",
                self.node,
                joined.number,
                joined.rank,
                joined.world_size,
            )
            self.round_cause = joined.cause
            return RendezvousInfo(store, joined.rank, joined.world_size, bootstrap)

    def _start(self, joined: Joined, sealed_at: int) -> tuple[EtcdV3Store, RendezvousStoreInfo]:
        """Watch the round and meet its ranks in its store; RoundAbandoned if rank 0 is
        lost before it published its address."""
        self._watch.begin(joined, sealed_at)
        if self._watch_peers:
            self._peers.follow(joined.participants)
        keys = self._state.keys
        # Under the run's lease, and a new one if etcd lost it (a new etcd on an empty
        # volume): a write retried under the lost lease waited out the store's 300 s while
        # the round's other nodes waited for it (the etcd-loss tests).
        store = EtcdV3Store(
            self._client,
            keys.store(joined.number),
            self._leases.job_lease,
            renew_lease=self._leases.replace_job_lease,
        )
        if joined.rank == 0 and joined.number > 2:
            self._state.drop_rounds_before(joined.number - 1)
        store.give_up = functools.partial(self._rank_zero_lost, joined)
        bootstrap = RendezvousStoreInfo.build(joined.rank, store, local_addr=self._addr)
        # torch's agent next assigns the ranks in this store (_assign_worker_ranks): rank 0
        # waits for every participant's role, the others for rank 0's answer, for the
        # store's 300 s. A participant that left the round after it was sealed (its own
        # round broke up, it died) never writes its role: give up as soon as the round
        # watch says the round is over (the agent joins the next; agent.py). The exit
        # barrier sets a give_up of its own.
        store.give_up = self._round_over
        return store, bootstrap

    def _round_over(self) -> str | None:
        """Why this node's round can no longer start, or None (the watch's events: O(1))."""
        return self._watch.restart_why if self._watch.num_nodes_waiting() > 0 else None

    def _own_lease_lapsed(self) -> None:
        """The watch saw this node's member key go while etcd answers: announce again."""
        if self._stop.is_set() or self._state.is_live(self.node):
            return  # it left (the key went with its revoked lease), or its keeper was first
        with contextlib.suppress(MembershipGivenUp):  # said; its next join raises it
            self._leases.renew_member("the round watch saw this node's member key deleted")

    def _rank_zero_lost(self, joined: Joined) -> str | None:
        """Why ``joined`` cannot start, or None: the other ranks wait in its store for
        rank 0's address, so rank 0's lease is the one that matters (one key read)."""
        first = joined.participants[0]
        if first == self.node or self._state.is_live(first):
            return None
        return f"lost {first}"

    def num_nodes_waiting(self) -> int:
        """Non-zero when this node must restart into a new round (a peer left or came).

        Driven by the watch's events: a member key deleted is a lost peer, a change of
        the round key is read (one key). Only a broken watch costs a full re-read.
        """
        return self._watch.num_nodes_waiting()

    def wait_for_membership_change(self, timeout: float) -> str | None:
        """Why this node must move to a new round, waiting up to ``timeout`` to find out."""
        return self._watch.wait_for_change(timeout)

    def peers_lost(self) -> list[str]:
        """The participants of this node's current round whose lease is gone, or that went
        on to a newer round without this node, read now.

        Non-empty means the round's collectives can never complete: the agent tells its
        workers so before it stops them (see ``MembershipAwareAgent._stop_workers``).
        """
        return self._watch.peers_lost()

    def announce_departure(self) -> None:
        """This node is leaving (rendezvous/departure.py): put its leaving key, on its
        member lease, and join no further round. Its member key stays until it exits, so
        its peers do not count it lost while its workers finish their step."""
        self._watch.departing = True
        self._client.put(
            self._state.keys.leaving_key(self.node), b"", lease=self._leases.member_lease
        )

    def is_leaving(self) -> bool:
        """This node's leaving key is there, as the round watch saw it: it announced its
        departure, or the operator marked it (a scale-down). No etcd request: the agent
        asks every monitor pass."""
        return self._watch.departing

    def standing(self) -> Standing:
        """Where this node stands, read now: the round key and the live nodes (one read
        of ``rdzv/``, which holds both)."""
        _, current, _, live = self._state.read()
        return Standing(
            me=self.node,
            my_round=self._watch.round,
            participants=self._watch.participants,
            current=current,
            others_live=len(live - {self.node}),
            min_nodes=self._joins.limits.min_nodes,
        )

    @property
    def lease_ttl(self) -> int:
        """The member lease's TTL as etcd granted it (at least what ``lease_ttl`` asked):
        a lost peer is noticed within this plus etcd's 0.5 s expiry check."""
        return self._leases.granted_ttl

    @property
    def round_number(self) -> int:
        """The round this node last joined (0 before the first)."""
        return self._watch.round

    def wake_on_change(self, wake: Callable[[], None]) -> None:
        self._watch.on_change = wake

    def put_run_record(self, key: str, value: bytes) -> None:
        """Put a record of the run (a hang) that lives as long as its rendezvous state:
        under the run's lease, kept alive while any agent runs. EtcdError if etcd fails."""
        self.register()
        self._client.put(key, value, lease=self._leases.job_lease)

    def is_closed(self) -> bool:
        try:
            _, current, _ = self._state.read_state()
        except EtcdError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        return current is not None and current.closed

    def set_closed(self) -> None:
        try:
            self.register()  # the round is written under the run's lease
            while True:
                _, current, kv = self._state.read_state()
                if current is not None and current.closed:
                    return
                base = current if current is not None else Round(number=self._watch.round)
                if self._state.write(replace(base, closed=True, finished=self._finished), kv):
                    return
        except EtcdError as exc:
            raise RendezvousConnectionError(str(exc)) from exc

    def get_run_id(self) -> str:
        return self._run_id

    def mark_finished(self) -> None:
        """This node's training finished: the close that follows (torch closes the run
        whenever an agent ends) records it, and a node that comes later exits 0."""
        self._finished = True

    def shutdown(self) -> bool:
        """torch's launcher calls this when its agent fails, closing the run for every
        node; not when this node gave its place up (its lease lapsed too often,
        ``LeaseHolder.rejoin``): that failure is its own, and its peers train on."""
        if self._leases.given_up is not None:
            self._leave()
            return False
        try:
            self.set_closed()
        except RendezvousError as exc:
            log.warning("etcd-v3: could not close run %s: %s", self._run_id, exc)
            return False
        finally:
            self._leave()
        return True


_REGISTERED: weakref.WeakSet[EtcdV3RendezvousHandler] = weakref.WeakSet()


def leave_registered() -> None:
    """Every handler of this process that registered and has not left drops its member
    key now, so peers learn at once, not after the lease TTL.

    At exit, and by ``elasticjob-run`` when a signal stops it: torch's launcher then
    skips ``shutdown()`` on purpose (that would close the run for every node), and by
    exit time a handler left only in cycles may have been collected, its key then left
    to its TTL (a flaky CI test). Weak: a handler a test dropped is not kept alive."""
    for handler in list(_REGISTERED):
        if not handler._stop.is_set():
            handler._leave()


atexit.register(leave_registered)


def _conf_seconds(params: RendezvousParameters, key: str, default: int) -> int:
    value = params.get_as_int(key, default)
    if value is None or value <= 0:
        raise ValueError(f"--rdzv-conf {key}={params.get(key)!r}: must be a positive integer")
    return value


def handler_from_params(params: RendezvousParameters) -> EtcdV3RendezvousHandler:
    """Build the handler from torchrun's parameters (``--rdzv-conf`` keys below).

    ``join_timeout`` (600 s), ``last_call_timeout`` (15 s, from ``min`` joined; only
    used while a live node has not joined), ``first_round_timeout`` (60 s: the same for
    the run's first round while fewer than ``ELASTICJOB_DESIRED_NODES`` have joined, the
    nodes the job asked for, which the operator sets; a job's pods start further apart
    than a regroup's nodes), ``job_ttl`` (3600 s: how long keys outlive the last agent),
    ``read_timeout`` (5 s), and ``lease_ttl`` (1 s): a node that dies or freezes is
    noticed within the TTL plus up to 0.5 s (etcd's expiry check). Smaller cannot be
    asked (etcd counts whole seconds); larger means slower detection but fewer
    keep-alives (five per TTL) and more slack for an agent or an etcd starved of CPU,
    which would otherwise look dead to its peers. etcd raises a TTL below its minimum,
    ``ceil(1.5 x --election-timeout)`` (2 s by default; the etcds we start allow 1 s),
    and the handler logs what it was granted. On an ElasticJob: ``spec.rdzvConf``
    (``PET_RDZV_CONF``), e.g. ``rdzvConf: {lease_ttl: "3"}``. TLS: ``protocol``,
    ``cacert``, ``cert``, ``key`` as torch's etcd rendezvous reads them, else the
    ``ELASTICJOB_ETCD_*`` variables (:mod:`elasticjob_runtime.etcd.tls`).
    """
    desired = desired_nodes(os.environ)  # a bad value stops it before it connects
    try:
        client = connect(
            params.endpoint, params.config, timeout=_conf_seconds(params, "read_timeout", 5)
        )
    except (ValueError, EtcdError) as exc:
        raise RendezvousConnectionError(str(exc)) from exc
    try:
        client.check()
    except EtcdError as exc:
        client.close()
        raise RendezvousConnectionError(str(exc)) from exc
    limits = Limits(
        params.min_nodes,
        params.max_nodes,
        _conf_seconds(params, "last_call_timeout", 15),
        desired=desired,
        first_round_wait=_conf_seconds(params, "first_round_timeout", 60),
    )
    handler = EtcdV3RendezvousHandler(
        client,
        params.run_id,
        limits,
        local_addr=params.local_addr,
        join_timeout=_conf_seconds(params, "join_timeout", 600),
        lease_ttl=_conf_seconds(params, "lease_ttl", DEFAULT_LEASE_TTL),
        job_ttl=_conf_seconds(params, "job_ttl", 3600),
    )
    try:
        handler.register()  # live from now on, as the agent warms up before it joins
    except EtcdError as exc:
        client.close()
        raise RendezvousConnectionError(str(exc)) from exc
    return handler
