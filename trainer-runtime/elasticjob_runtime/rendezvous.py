"""The ``etcd-v3`` rendezvous: torch elastic's handler interface on etcd's v3 API.

Two pieces, both on :class:`~elasticjob_runtime.etcd_client.EtcdClient`:

* :class:`EtcdV3RendezvousBackend`, torch's ``RendezvousBackend`` contract
  (state bytes plus a token; compare-and-set on the key's ``mod_revision`` in one
  transaction), so it also plugs into torch's ``DynamicRendezvousHandler``.
* :class:`EtcdV3RendezvousHandler`, which the ``etcd-v3`` name resolves to. It
  writes its rounds through that backend, but membership comes from etcd leases:
  every agent keeps a member key alive under its own short lease and watches the
  run's prefix. A peer that dies loses its key within the lease TTL; a newcomer
  opens a new round; either way the watch fires and ``num_nodes_waiting()`` tells
  the agent to restart its workers into the next round at once. torch's dynamic
  handler instead waits out heartbeats (15 s by default), a 30 s last call and,
  for a peer that died silently, the collective timeout (pytorch#111646).

The lease TTL (``lease_ttl``, 1 s by default) is how long a dead or frozen node goes
unnoticed; :mod:`elasticjob_runtime.leases` has the rules and etcd's limits on it.

All keys sit under :func:`~elasticjob_runtime.contract.run_prefix` and carry leases,
so they vanish with the job.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import math
import os
import random
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

# The .api submodule, not the package: torch loads this entry point while the
# package itself is still initialising.
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elasticjob_runtime import contract
from elasticjob_runtime.etcd_client import (
    Change,
    EtcdClient,
    EtcdError,
    EtcdLeaseNotFound,
    KeyValue,
)
from elasticjob_runtime.etcd_store import EtcdV3Store, RoundAbandoned
from elasticjob_runtime.etcd_tls import connect
from elasticjob_runtime.leases import (
    DEFAULT_LEASE_TTL,
    granted_ttl_message,
    job_lease_due,
    keep_alive_timing,
    late_refresh_warning,
)
from elasticjob_runtime.membership import (
    Closed,
    Enter,
    Follow,
    Joined,
    Limits,
    Open,
    Round,
    Seal,
    Standby,
    decide_join,
    decide_seal,
    decide_standby,
    decode_participants,
    encode_participants,
    gone_on_without,
    leader_of,
    lost_participants,
    restart_reason,
)

log = logging.getLogger(__name__)

BACKEND_NAME = "etcd-v3"
# While the keep-alive keeps failing (etcd down), say so once every this many seconds.
KEEP_ALIVE_QUIET_S = 5.0


class RunFinishedError(RendezvousClosedError):
    """The run this node asked to join has finished training: there is nothing left to
    do, which is no failure (the launcher exits 0 and says so)."""


def finished_run_message(run_id: str, etcd: str) -> str:
    """What a node that comes to a finished run is told. A late scale-up pod needs no
    more than the first clause, but the same command run again (same --rdzv-id, same etcd)
    would otherwise look like a job that trained nothing: say how to start afresh."""
    return (
        f"run {run_id} finished training before this node joined; nothing is left to do. "
        f"To train again, start a new run: another --rdzv-id, or delete this run's keys from "
        f"the etcd at {etcd} (etcdctl del --prefix {contract.run_prefix(run_id)}); a script "
        "given the same checkpoint directory resumes its finished state"
    )


def state_key(run_id: str) -> str:
    return contract.run_prefix(run_id) + "rdzv/state"


def members_prefix(run_id: str) -> str:
    return contract.run_prefix(run_id) + "rdzv/members/"


def state_digest_key(run_id: str) -> str:
    """Where the backend keeps the SHA-256 of the state it wrote. Beside the state, not in
    it: the state stays the caller's bytes (the handler reads the round's JSON straight
    from etcd, and so can etcdctl), and one prefix read of the state key returns both at
    one revision."""
    return state_key(run_id) + ".sha256"


def state_digest(state: bytes) -> bytes:
    return hashlib.sha256(state).hexdigest().encode()


def state_problem(state: bytes, digest: bytes | None, digest_key: str) -> str | None:
    """Why ``state`` is not one the backend wrote, or None. torch's backends store base64
    and call a value that does not decode corrupt; ours stores the bytes as they are, so a
    digest written in the same transaction is what tells a foreign value apart."""
    if digest is None:
        return (
            f"{digest_key}, which the etcd-v3 backend writes with every state, is missing: "
            "something else wrote the state"
        )
    if digest != state_digest(state):
        return (
            f"its SHA-256 is not the one in {digest_key}, written with it: something other "
            "than the etcd-v3 backend overwrote it"
        )
    return None


class EtcdV3RendezvousBackend(RendezvousBackend):
    """Rendezvous state in one etcd key; the token is the key's ``mod_revision``.

    torch's contract (``test_torch_contracts.py`` holds it here): an etcd that cannot be
    reached is a ``RendezvousConnectionError``, a stored state the backend did not write a
    ``RendezvousStateError`` (see :func:`state_problem`).
    """

    def __init__(self, client: EtcdClient, run_id: str, lease: int | None = None) -> None:
        if not run_id:
            raise ValueError("the run id must be a non-empty string (set --rdzv-id / PET_RDZV_ID)")
        self._client = client
        self._run_id = run_id
        self._key = state_key(run_id)
        self._digest_key = state_digest_key(run_id)
        self.lease = lease

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Any] | None:
        try:
            found = self._client.snapshot(self._key).items  # the state and its digest
        except EtcdError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        kv = found.get(self._key)
        if kv is None:
            return None
        digest = found.get(self._digest_key)
        problem = state_problem(
            kv.value, None if digest is None else digest.value, self._digest_key
        )
        if problem is not None:
            raise RendezvousStateError(
                f"the rendezvous state {self._key} in etcd at {self._client.where} is corrupt: "
                f"{problem}. To start the run afresh, delete its keys (etcdctl del --prefix "
                f"{contract.run_prefix(self._run_id)}) or use another --rdzv-id"
            )
        return kv.value, kv.mod_revision

    def set_state(
        self, state: bytes, token: Any | None = None, also: Mapping[str, bytes] | None = None
    ) -> tuple[bytes, Any, bool] | None:
        """Write ``state`` if nobody wrote since ``token``; return what is stored now.

        A token that is not one of ours (or None) means "only if the key is absent",
        which is what a node that has never read the state wants. ``also`` (not part of
        torch's contract): keys written in the same transaction, only if ``state`` is; the
        state's digest is always one of them.
        """
        revision = token if isinstance(token, int) and not isinstance(token, bool) else None
        written = {self._digest_key: state_digest(state), **(also or {})}
        try:
            ok, kv = self._client.compare_and_set(self._key, state, revision, self.lease, written)
        except EtcdError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        if kv is None:
            return None
        return kv.value, kv.mod_revision, ok


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
    ) -> None:
        if limits.min_nodes < 1 or limits.max_nodes < limits.min_nodes:
            raise ValueError(
                f"bad node range {limits.min_nodes}:{limits.max_nodes}; use MIN:MAX with "
                "1 <= MIN <= MAX"
            )
        self._client = client
        self._run_id = run_id
        self._limits = limits
        self._addr = local_addr or os.environ.get(contract.POD_IP) or socket.getfqdn()
        self._join_timeout = join_timeout
        self._lease_ttl = lease_ttl
        self._prefix = contract.run_prefix(run_id) + "rdzv/"
        self._members = members_prefix(run_id)
        self._rounds = contract.run_prefix(run_id) + "rounds/"
        self._state_key = state_key(run_id)
        self.node = f"{self._addr}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self._job_ttl = job_ttl
        # Leases, the member key and the keeper thread come with register(), not here:
        # building a handler touches nothing.
        self._registered = False
        self._register_lock = threading.Lock()
        self._job_lease = 0
        self._backend = EtcdV3RendezvousBackend(client, run_id)
        self._member_lease = 0
        self._granted_ttl = 0  # what etcd granted for the member lease; 0 until it has
        self._lease_lock = threading.Lock()  # the keeper and a join may both re-announce
        self._refreshed_at: float | None = None  # the last refresh, None after a failed one
        self._job_refreshed_at = 0.0
        self._warned_late_at = -math.inf
        self._round = 0
        self._participants: tuple[str, ...] = ()
        self._changed = threading.Event()
        self._watch_broken = threading.Event()
        self._restart_why: str | None = None
        self._entered: int | None = None  # the round whose join key this node put last
        self._leading: int | None = None  # a round this node leads since its leader went
        self._changes_lock = threading.Lock()
        self._state_changed = False  # the watch saw the round key change
        self._gone: set[str] = set()  # nodes whose member key the watch saw deleted
        self._cancel_watch: Callable[[], None] | None = None
        self._stop = threading.Event()
        self._finished = False  # training finished here: the close says so (mark_finished)

    # -- leases -----------------------------------------------------------------

    def register(self) -> None:
        """Take part in the run: the run's lease, this node's member lease and key, and a
        thread keeping both alive. Once; later calls do nothing.

        :func:`handler_from_params` calls it at once, so a node counts as live (a first
        round waits for it) while its agent still warms up; the first
        :meth:`next_rendezvous` calls it for a handler built directly.
        """
        with self._register_lock:
            if self._registered:
                return
            # The keeper has its own connection, with a short per-request timeout and quick
            # reconnects: a refresh stuck on a slow etcd or a dead connection must not eat
            # the TTL, and its failures must not break the main connection's watches. It is
            # connected before the first lease is granted: a first refresh that also had to
            # open the connection (DNS, TCP, the TLS handshake) in a quarter of a 1 s TTL
            # lost the lease on a busy cluster (seen on kind), and the node looked gone.
            timing = keep_alive_timing(self._lease_ttl)  # the granted TTL's, once granted
            keeper_client = self._client.another(timing.timeout, timing.interval)
            try:
                keeper_client.connect(self._client.timeout)
            except EtcdError as exc:
                log.warning("etcd-v3: lease keeper: %s (it keeps trying)", exc)
            self._take_job_lease()
            self._announce()
            now = time.monotonic()
            self._refreshed_at = now
            self._job_refreshed_at = now
            keeper_client.timeout = keep_alive_timing(self._granted_ttl).timeout
            keeper = threading.Thread(
                target=_keep_alive,
                args=(weakref.ref(self), self._stop, keeper_client),
                name=f"etcd-v3-lease-{self.node}",
                daemon=True,
            )
            keeper.start()
            atexit.register(_leave_weak, weakref.ref(self))
            self._registered = True

    def _announce(self) -> None:
        """Take a fresh member lease and announce this node under it."""
        with self._lease_lock:
            lease = self._client.grant_lease(self._lease_ttl)
            if lease.ttl != self._granted_ttl:  # the first time (or another etcd's minimum)
                self._granted_ttl = lease.ttl
                level, message = granted_ttl_message(self._lease_ttl, lease.ttl, self._client.where)
                log.log(level, "etcd-v3: %s", message)
            self._member_lease = lease.id
            value = json.dumps({"addr": self._addr, "pid": os.getpid()}).encode()
            self._client.put(self._members + self.node, value, lease=self._member_lease)

    def keep_alive(self, client: EtcdClient | None = None) -> None:
        """Refresh the member lease once (through ``client``, the keeper's connection),
        and the run's lease when it is due; take new ones where etcd has lost them."""
        via = client or self._client
        asked, previous = time.monotonic(), self._refreshed_at
        self._refreshed_at = None  # until this refresh has worked
        lost = not via.refresh(self._member_lease)
        if lost and self._stop.is_set():
            return  # revoked by _leave (which stops this first): do not come back
        if lost:
            log.warning("etcd-v3: node %s lost its lease; registering again", self.node)
            self._announce()
        done = time.monotonic()
        if previous is not None and not lost:
            # Failures in between are reported as such; a late refresh after a working
            # one means this thread (or etcd) did not get to run in time.
            late = late_refresh_warning(
                done - previous, self._granted_ttl, done - self._warned_late_at
            )
            if late is not None:
                self._warned_late_at = done
                log.warning("etcd-v3: %s: %s", self.node, late)
        self._refreshed_at = done
        if not job_lease_due(asked - self._job_refreshed_at, lost):
            return
        if not via.refresh(self._job_lease):
            # etcd lost the run's lease (a new etcd pod on an empty volume): every write
            # under it would fail with "requested lease not found" for ever
            log.warning("etcd-v3: the run's lease is gone (etcd lost its data?); taking a new one")
            self._take_job_lease()
        self._job_refreshed_at = asked

    def _take_job_lease(self) -> None:
        """A new run lease, which the round key and the rounds' stores are written under."""
        self._job_lease = self._client.grant(self._job_ttl)
        self._backend.lease = self._job_lease

    def _renew_leases(self, why: str) -> None:
        """A write failed because etcd does not know a lease of ours: take both anew."""
        log.warning("etcd-v3: %s: %s; taking new leases", self.node, why)
        self._announce()
        self._take_job_lease()

    def _leave(self) -> None:
        """Drop the member key now so peers learn at once, not after the lease TTL."""
        self._stop.set()
        if self._cancel_watch is not None:
            self._cancel_watch()
            self._cancel_watch = None
        if not self._member_lease:
            return  # never registered: nothing to drop
        try:
            self._client.revoke(self._member_lease)
        except EtcdError as exc:
            log.warning("etcd-v3: could not revoke the lease of %s: %s", self.node, exc)

    # -- reading ------------------------------------------------------------------

    def _read(self) -> tuple[int, Round | None, KeyValue | None, frozenset[str]]:
        """One snapshot of ``rdzv/``: revision, round, its key, and the live nodes. O(N):
        only where the watch's events cannot be trusted (it broke)."""
        snap = self._client.snapshot(self._prefix)
        kv = snap.items.get(self._state_key)
        current = Round.decode(kv.value) if kv is not None else None
        return snap.revision, current, kv, self._member_names(snap.items)

    def _read_state(self) -> tuple[int, Round | None, KeyValue | None]:
        """The round key alone, with the revision it was read at: O(1)."""
        snap = self._client.snapshot(self._state_key)
        kv = snap.items.get(self._state_key)
        return snap.revision, (Round.decode(kv.value) if kv is not None else None), kv

    def _live(self) -> tuple[int, frozenset[str]]:
        snap = self._client.snapshot(self._members)
        return snap.revision, self._member_names(snap.items)

    def _member_names(self, keys: Iterable[str]) -> frozenset[str]:
        """The nodes whose member key is among ``keys``: the live nodes."""
        return frozenset(k[len(self._members) :] for k in keys if k.startswith(self._members))

    def _joins(self, number: int) -> tuple[int, list[str]]:
        """Who has entered round ``number``, in the order they entered."""
        prefix = self._joins_prefix(number)
        snap = self._client.snapshot(prefix)
        ordered = sorted(snap.items.values(), key=lambda kv: kv.mod_revision)
        return snap.revision, [kv.key[len(prefix) :] for kv in ordered]

    def _round_prefix(self, number: int) -> str:
        # Zero-padded so that a key range covers exactly the older rounds.
        return f"{self._rounds}{number:010d}/"

    def _joins_prefix(self, number: int) -> str:
        return self._round_prefix(number) + "joins/"

    def _sealed_key(self, number: int) -> str:
        return self._round_prefix(number) + "sealed"

    def _watch(self, revision: int) -> None:
        """(Re)start the watch on ``rdzv/`` (the round key and the members) from just
        after ``revision``; the changed keys go to :meth:`_note_changes`."""
        if self._cancel_watch is not None:
            self._cancel_watch()
        self._cancel_watch = None
        self._watch_broken.clear()
        try:
            self._cancel_watch = self._client.watch_prefix(
                self._prefix,
                revision + 1,
                self._changed.set,
                self._watch_broken.set,
                on_keys=self._note_changes,
            )
        except EtcdError:
            # Right after etcd comes back, gRPC may refuse the new stream even though a
            # read just worked: stay "broken" so the next check tries again, rather than
            # believing a watch exists and never hearing of a change.
            self._watch_broken.set()
            raise

    def _note_changes(self, changes: list[Change]) -> None:
        """From the watch thread: which keys changed, for the next membership check."""
        with self._changes_lock:
            for change in changes:
                if change.key == self._state_key:
                    self._state_changed = True
                elif change.deleted and change.key.startswith(self._members):
                    self._gone.add(change.key[len(self._members) :])

    def _write(
        self, new: Round, kv: KeyValue | None, also: Mapping[str, bytes] | None = None
    ) -> bool:
        """Compare-and-set the round key (and ``also``, in the same transaction)."""
        token = None if kv is None else kv.mod_revision
        result = self._backend.set_state(new.encode(), token, also)
        return result is not None and result[2]

    def _store_prefix(self, number: int) -> str:
        # Zero-padded so that a key range covers exactly the older rounds.
        return f"{contract.run_prefix(self._run_id)}store/{number:010d}/"

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
        if self._cancel_watch is not None:
            self._cancel_watch()
            self._cancel_watch = None
        self._restart_why = None
        deadline = time.monotonic() + self._join_timeout
        while True:
            joined, sealed_at = self._join(deadline)
            try:
                self._round = joined.number
                self._participants = joined.participants
                with self._changes_lock:
                    # The first check reads the round key (one key): a newer round may
                    # have opened before the watch below has delivered its first events.
                    self._state_changed, self._gone = True, set()
                try:
                    # From the seal on: a peer lost or a newer round opened since then,
                    # even before this node read the round, is in the watch's events.
                    self._watch(sealed_at)
                except EtcdError as exc:  # the first membership check watches again
                    log.warning("etcd-v3: %s: cannot watch yet (%s); retrying", self.node, exc)
                self._changed.set()  # the first membership check looks at once
                store = EtcdV3Store(
                    self._client, self._store_prefix(joined.number), self._job_lease
                )
                if joined.rank == 0 and joined.number > 2:
                    self._drop_rounds_before(joined.number - 1)
                store.give_up = functools.partial(self._rank_zero_lost, joined)
                bootstrap = RendezvousStoreInfo.build(joined.rank, store, local_addr=self._addr)
                store.give_up = None
            except RoundAbandoned as exc:
                log.info("etcd-v3: %s: round %d broke up: %s", self.node, joined.number, exc)
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
            return RendezvousInfo(store, joined.rank, joined.world_size, bootstrap)

    def peers_lost(self) -> list[str]:
        """The participants of this node's current round whose lease is gone, or that went
        on to a newer round without this node (:func:`gone_on_without`), read now.

        Non-empty means the round's collectives can never complete: the agent tells its
        workers so before it stops them (see ``MembershipAwareAgent._stop_workers``).
        """
        try:
            _, live = self._live()
            _, current, _ = self._read_state()
        except EtcdError as exc:
            log.warning("etcd-v3: cannot read the live nodes: %s", exc)
            return []
        lost = lost_participants(self._participants, live)
        gone_on = gone_on_without(current, self.node, self._round, self._participants)
        return lost + [p for p in gone_on if p not in lost]

    def _rank_zero_lost(self, joined: Joined) -> str | None:
        """Why ``joined`` cannot start, or None: the other ranks wait in its store for
        rank 0's address, so rank 0's lease is the one that matters (one key read)."""
        first = joined.participants[0]
        if first == self.node or self._client.get(self._members + first) is not None:
            return None
        return f"lost {first}"

    def _join(self, deadline: float) -> tuple[Joined, int]:
        """Act on :func:`decide_join` until this node is in a sealed round.

        Returns the round and the etcd revision it was sealed at. An etcd outage
        (a restart, a failover) is ridden out until the join deadline.
        """
        last_call: float | None = None  # the leader's last-call deadline
        while True:
            try:
                revision, current, kv = self._read_state()
                if (
                    self._entered is not None
                    and current is not None
                    and current.number > self._entered > self._round
                ):
                    # The round this node entered was sealed and a newer one opened before
                    # this node read it: if it is in the sealed record, that round is binding.
                    found = self._sealed_with_me(self._entered)
                    self._entered = None
                    if found is not None:
                        return found
                decision = decide_join(current, self.node, self._limits, self._round, self._entered)
                if isinstance(decision, Joined):
                    self._entered = None
                    assert kv is not None  # a sealed round came from its key
                    return decision, kv.mod_revision
                if isinstance(decision, Closed) and decision.finished:
                    raise RunFinishedError(finished_run_message(self._run_id, self._client.where))
                if isinstance(decision, Closed):
                    raise RendezvousClosedError(
                        f"the rendezvous of run {self._run_id} is closed: a node left it "
                        "without finishing (out of restarts, or its rendezvous failed); "
                        "a new run needs a new --rdzv-id"
                    )
                if isinstance(decision, Standby):
                    live_at, live = self._live()
                    step = decide_standby(decision.round, self.node, live)
                    if isinstance(step, Open):
                        self._open(step, kv)
                        continue
                    deadline = time.monotonic() + self._join_timeout
                    self._client.wait_for_change(self._prefix, live_at, self._join_timeout)
                    continue
                if isinstance(decision, Open):
                    self._open(decision, kv)
                    continue
                if isinstance(decision, Enter):
                    self._enter(decision.number)
                    continue
                if isinstance(decision, Follow) and self._leading != decision.number:
                    self._follow(decision, revision, deadline)
                    continue
                assert kv is not None and current is not None  # a forming round's key
                last_call = self._lead(current, kv, last_call, deadline)
            except (EtcdError, RendezvousConnectionError) as exc:
                if time.monotonic() > deadline:
                    raise RendezvousConnectionError(str(exc)) from exc
                if EtcdLeaseNotFound in (type(exc), type(exc.__cause__)):
                    # not worth waiting for the keeper (which may itself be cut off): a
                    # write under a lease etcd lost fails the same way for ever
                    self._renew_leases(str(exc))
                    continue
                log.warning("etcd-v3: %s: %s; retrying", self.node, exc)
                time.sleep(0.5)

    def _time_left(self, deadline: float, why: str) -> float:
        """Seconds to the join deadline; past it, the timeout saying what was missing."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousTimeoutError(
                f"no rendezvous within {self._join_timeout:.0f}s for run {self._run_id}: {why}"
            )
        return left

    def _open(self, step: Open, kv: KeyValue | None) -> None:
        """Open the next round (if no other node just did) and enter it."""
        if self._write(step.round, kv):
            log.info("etcd-v3: %s: opened round %d: %s", self.node, step.round.number, step.why)
            self._enter(step.round.number)

    def _enter(self, number: int) -> None:
        """Put this node's join key for round ``number``, on its member lease: it vanishes
        with the node, so a leader never waits for a node that died after entering."""
        self._client.put(self._joins_prefix(number) + self.node, b"", lease=self._member_lease)
        self._entered = number

    def _sealed_with_me(self, number: int) -> tuple[Joined, int] | None:
        kv = self._client.get(self._sealed_key(number))
        if kv is None:
            return None
        participants = decode_participants(kv.value)
        if self.node not in participants:
            return None
        log.info("etcd-v3: %s: round %d, sealed with it, is binding", self.node, number)
        return Joined(number, participants, participants.index(self.node)), kv.mod_revision

    def _follow(self, decision: Follow, revision: int, deadline: float) -> None:
        """Wait for the leader to seal the round; on a quiet spell, check that the leader
        and this node's own join key are still there (a lease can run out)."""
        left = self._time_left(
            deadline, f"round {decision.number} was not sealed by {decision.leader}"
        )
        recheck = max(self._granted_ttl, 1) + 1.0 + random.uniform(0, 0.5)
        if self._client.wait_for_change(self._state_key, revision, min(left, recheck)):
            return
        if self._client.get(self._joins_prefix(decision.number) + self.node) is None:
            self._entered = None  # its lease ran out and was taken again: enter again
        if self._client.get(self._members + decision.leader) is not None:
            return
        _, live = self._live()
        _, joins = self._joins(decision.number)
        if leader_of(decision.leader, joins, live) == self.node:
            log.info(
                "etcd-v3: %s: leader %s of round %d is gone; leading it",
                self.node,
                decision.leader,
                decision.number,
            )
            self._leading = decision.number

    def _lead(
        self, current: Round, kv: KeyValue, last_call: float | None, deadline: float
    ) -> float | None:
        """Seal the forming round once :func:`decide_seal` says so, else wait for a join,
        a lost node or the last call. Returns the last-call deadline to keep."""
        live_at, live = self._live()
        if self.node not in live:
            self._announce()  # its lease ran out: a new one, and enter again under it
            self._entered = None
            return last_call
        joins_at, joins = self._joins(current.number)
        verdict = decide_seal(joins, live, self._limits, last_call, time.time())
        if isinstance(verdict, Seal):
            sealed = Round(current.number, verdict.participants, True, leader=current.leader)
            record = {self._sealed_key(current.number): encode_participants(verdict.participants)}
            if self._write(sealed, kv, also=record):
                log.info(
                    "etcd-v3: %s: sealed round %d with %d nodes",
                    self.node,
                    current.number,
                    len(verdict.participants),
                )
            return None
        left = self._time_left(deadline, verdict.why)
        if verdict.until is not None:
            left = min(left, max(verdict.until - time.time(), 0.0) + 0.05)
        watched = [self._state_key, self._members, self._joins_prefix(current.number)]
        self._client.wait_for_change(watched, min(live_at, joins_at), left)
        return verdict.until

    def _drop_rounds_before(self, number: int) -> None:
        """Finished rounds' keys are no use to anyone; keep etcd small."""
        try:
            self._client.delete_range(self._store_prefix(0), self._store_prefix(number))
            self._client.delete_range(self._round_prefix(0), self._round_prefix(number))
        except EtcdError as exc:
            log.warning("etcd-v3: could not drop old rounds' keys: %s", exc)

    def num_nodes_waiting(self) -> int:
        """Non-zero when this node must restart into a new round (a peer left or came).

        Driven by the watch's events: a member key deleted is a lost peer, a change of
        the round key is read (one key). Only a broken watch costs a full re-read.
        """
        if self._restart_why is not None:
            return 1
        if not self._changed.is_set():
            return 0
        self._changed.clear()
        with self._changes_lock:
            state_changed, gone = self._state_changed, set(self._gone)
            self._state_changed = False
        try:
            if self._watch_broken.is_set():
                # The stream died (etcd restarted, a member failed over): watch again.
                # Comparing state, not counting events, means nothing in between is lost.
                revision, current, _, live = self._read()
                log.info("etcd-v3: %s: watch lost; watching again", self.node)
                self._watch(revision)
                lost = lost_participants(self._participants, live)
            else:
                lost = [p for p in self._participants if p in gone]
                if not state_changed and not lost:
                    return 0
                _, current, _ = self._read_state()
        except EtcdError as exc:
            log.warning("etcd-v3: cannot check membership: %s", exc)
            with self._changes_lock:
                self._state_changed = self._state_changed or state_changed
            self._changed.set()
            return 0
        self._restart_why = restart_reason(current, lost, self._round)
        if self._restart_why is None:
            return 0
        log.info("etcd-v3: %s restarts its workers: %s", self.node, self._restart_why)
        return 1

    def wait_for_membership_change(self, timeout: float) -> str | None:
        """Why this node must move to a new round, waiting up to ``timeout`` to find out."""
        deadline = time.monotonic() + timeout
        while True:
            if self.num_nodes_waiting() > 0:
                return self._restart_why
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._changed.wait(left)

    @property
    def lease_ttl(self) -> int:
        """The member lease's TTL as etcd granted it (at least what ``lease_ttl`` asked):
        a lost peer is noticed within this plus etcd's 0.5 s expiry check."""
        return self._granted_ttl

    @property
    def round_number(self) -> int:
        """The round this node last joined (0 before the first)."""
        return self._round

    def put_run_record(self, key: str, value: bytes) -> None:
        """Put a record of the run (a hang) that lives as long as its rendezvous state:
        under the run's lease, kept alive while any agent runs. EtcdError if etcd fails."""
        self.register()
        self._client.put(key, value, lease=self._job_lease)

    def is_closed(self) -> bool:
        try:
            _, current, _ = self._read_state()
        except EtcdError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        return current is not None and current.closed

    def set_closed(self) -> None:
        try:
            self.register()  # the round is written under the run's lease
            while True:
                _, current, kv = self._read_state()
                if current is not None and current.closed:
                    return
                base = current if current is not None else Round(number=self._round)
                if self._write(replace(base, closed=True, finished=self._finished), kv):
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
        try:
            self.set_closed()
        except RendezvousError as exc:
            log.warning("etcd-v3: could not close run %s: %s", self._run_id, exc)
            return False
        finally:
            self._leave()
        return True


def _keep_alive(
    ref: weakref.ref[EtcdV3RendezvousHandler], stop: threading.Event, client: EtcdClient
) -> None:
    """Refresh the leases five times per TTL through ``client`` (closed on the way out);
    exits when the handler is gone or has left.

    Nothing else in an agent holds the GIL for long (torch's agent loop sleeps between
    monitor ticks, etcd calls and process waits release it), so this thread runs on time
    unless the whole process is starved of CPU, which ``keep_alive`` then reports.
    """
    failure_told: float | None = None  # when a failure was last logged; None: working
    try:
        while True:
            handler = ref()
            if handler is None:
                return
            interval = keep_alive_timing(handler.lease_ttl).interval
            try:
                handler.keep_alive(client)
                if failure_told is not None:
                    log.info("etcd-v3: lease keep-alive works again")
                failure_told = None
            except Exception as exc:  # keep trying: a dead keeper would silently drop the node
                now = time.monotonic()
                if failure_told is None or now - failure_told >= KEEP_ALIVE_QUIET_S:
                    log.warning("etcd-v3: lease keep-alive failed (retrying): %s", exc)
                    failure_told = now
            del handler
            if stop.wait(interval):
                return
    finally:
        client.close()


def _leave_weak(ref: weakref.ref[EtcdV3RendezvousHandler]) -> None:
    handler = ref()
    if handler is not None and not handler._stop.is_set():
        handler._leave()


def _conf_seconds(params: RendezvousParameters, key: str, default: int) -> int:
    value = params.get_as_int(key, default)
    if value is None or value <= 0:
        raise ValueError(f"--rdzv-conf {key}={params.get(key)!r}: must be a positive integer")
    return value


def handler_from_params(params: RendezvousParameters) -> EtcdV3RendezvousHandler:
    """Build the handler from torchrun's parameters (``--rdzv-conf`` keys below).

    ``join_timeout`` (600 s), ``last_call_timeout`` (15 s; only used while a live
    node has not joined), ``job_ttl`` (3600 s: how long keys outlive the last agent),
    ``read_timeout`` (5 s), and ``lease_ttl`` (1 s): a node that dies or freezes is
    noticed within the TTL plus up to 0.5 s (etcd's expiry check). Smaller cannot be
    asked (etcd counts whole seconds); larger means slower detection but fewer
    keep-alives (five per TTL) and more slack for an agent or an etcd starved of CPU,
    which would otherwise look dead to its peers. etcd raises a TTL below its minimum,
    ``ceil(1.5 x --election-timeout)`` (2 s by default; the etcds we start allow 1 s),
    and the handler logs what it was granted. On an ElasticJob: ``spec.rdzvConf``
    (``PET_RDZV_CONF``), e.g. ``rdzvConf: {lease_ttl: "3"}``. TLS: ``protocol``,
    ``cacert``, ``cert``, ``key`` as torch's etcd rendezvous reads them, else the
    ``ELASTICJOB_ETCD_*`` variables (:mod:`elasticjob_runtime.etcd_tls`).
    """
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
        params.min_nodes, params.max_nodes, _conf_seconds(params, "last_call_timeout", 15)
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
