"""A node's two leases and the thread that keeps them alive.

The member lease holds the node's member key (and its join keys): it is how peers learn
within a TTL that the node died or froze. The run's lease holds the round key, the
rounds' stores and the run records, so they outlive any one agent by ``job_ttl`` and
vanish with the job. The rules (timing, what to tell the user) are pure, in
:mod:`elasticjob_runtime.rendezvous.leases`; this is their I/O.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable

from elasticjob_runtime.etcd.client import EtcdClient, EtcdError, EtcdTLSError
from elasticjob_runtime.etcd.records import Member, encode_member
from elasticjob_runtime.rendezvous.keys import RendezvousKeys
from elasticjob_runtime.rendezvous.leases import (
    LAPSE_WINDOW_S,
    RETRY_AFTER_S,
    granted_ttl_message,
    job_lease_due,
    keep_alive_timing,
    keeper_cut_off,
    keeper_recheck_after,
    lapses_message,
    late_refresh_warning,
    leaves_after_lapse,
)
from elasticjob_runtime.rendezvous.liveness import LivenessPort, open_liveness_port

log = logging.getLogger(__name__)

# While the keep-alive keeps failing (etcd down), say so once every this many seconds.
KEEP_ALIVE_QUIET_S = 5.0


class MembershipGivenUp(RuntimeError):
    """This node lost its member lease too often to announce itself again
    (:func:`~elasticjob_runtime.rendezvous.leases.leaves_after_lapse`); it leaves the job."""


class LeaseHolder:
    """The member lease (and key) and the run's lease of ``node``, kept alive by a thread
    of their own from :meth:`start` until :meth:`leave`."""

    def __init__(
        self,
        client: EtcdClient,
        keys: RendezvousKeys,
        node: str,
        addr: str,
        lease_ttl: int,
        job_ttl: int,
        on_job_lease: Callable[[int], None],
    ) -> None:
        self._client = client
        self._keys = keys
        self._node = node
        self._addr = addr
        self._lease_ttl = lease_ttl
        self._job_ttl = job_ttl
        self._on_job_lease = on_job_lease  # the round key is written under the run's lease
        self.stop = threading.Event()  # set: the node left (or, in tests, "died")
        self.member_lease = 0
        self.job_lease = 0
        self.granted_ttl = 0  # what etcd granted for the member lease; 0 until it has
        self._lock = threading.Lock()  # the keeper and a join may both re-announce
        self._job_lock = threading.Lock()  # the keeper and a round's store may both renew
        self._refreshed_at: float | None = None  # the last refresh, None after a failed one
        self._job_refreshed_at = 0.0
        self._warned_late_at = -math.inf
        # The keeper: its thread, its connection and its generation. A keeper whose
        # generation is not the holder's has been replaced and exits at its next turn.
        self._keeper_lock = threading.Lock()
        self._revive_lock = threading.Lock()  # the join and renew_member's recheck
        self._keeper_generation = 0
        self._keeper_client: EtcdClient | None = None
        self._keeper_thread: threading.Thread | None = None
        # When the keeper last got an answer from etcd (a refresh that worked or that etcd
        # refused): one with none for half a TTL is cut off (see revive_keeper_if_stalled).
        self._answered_at = 0.0
        # When each member lease of this node lapsed, and why the node gave up its place
        # (None: it has not): see rejoin.
        self._lapsed_at: list[float] = []
        self._lapsed_leases: set[int] = set()  # each lapse counts once, however found
        self.given_up: str | None = None
        # Open from start until leave, published in the member key: a peer whose connection
        # to it is refused knows this agent died before its lease says so (liveness.py).
        self._liveness: LivenessPort | None = None

    def start(self, deadline: float) -> None:
        """Take both leases, announce the node and start the keeper thread. A failed
        grant or put is tried again until ``deadline`` (the join's): an etcd starved of
        CPU answers "request timed out" to a write it applies a moment later, and one
        such answer used to end the agent (the 1,024-agent bench round).

        The keeper has its own connection, with a short per-request timeout and quick
        reconnects: a refresh stuck on a slow etcd or a dead connection must not eat the
        TTL, and its failures must not break the main connection's watches. It is
        connected before the first lease is granted: a first refresh that also had to open
        the connection (DNS, TCP, the TLS handshake) in a quarter of a 1 s TTL lost the
        lease on a busy cluster (seen on kind), and the node looked gone.
        """
        timing = keep_alive_timing(self._lease_ttl)  # the granted TTL's, once granted
        keeper_client = self._client.another(timing.timeout, timing.interval)
        try:
            keeper_client.connect(self._client.timeout)
        except EtcdError as exc:
            log.warning("etcd-v3: lease keeper: %s (it keeps trying)", exc)
        self._liveness = open_liveness_port(self._addr)
        self._until(deadline, self.take_job_lease, "taking the run's lease")
        self._until(deadline, self.announce, "announcing this node")
        now = time.monotonic()
        self._refreshed_at = now
        self._job_refreshed_at = now
        self._answered_at = now
        keeper_client.timeout = keep_alive_timing(self.granted_ttl).timeout
        self._start_keeper(keeper_client)

    def _until(self, deadline: float, call: Callable[[], None], what: str) -> None:
        """``call`` until it works; raise its error where waiting will not help (TLS), the
        node left, or the next try would come after ``deadline``. Each try takes a new
        lease, so one etcd lost meanwhile is no obstacle."""
        while True:
            try:
                call()
                return
            except EtcdError as exc:
                late = time.monotonic() + RETRY_AFTER_S > deadline
                if isinstance(exc, EtcdTLSError) or late or self.stop.is_set():
                    raise
                log.warning("etcd-v3: %s: %s failed (%s); trying again", self._node, what, exc)
                self.stop.wait(RETRY_AFTER_S)

    def _start_keeper(self, client: EtcdClient) -> None:
        """Run a keeper on ``client``; a keeper already running is told to stop, and its
        connection closed (which ends a call stuck on it). The new keeper refreshes over
        the node's main connection until its own is open: a keeper that waited for a new
        connection let the lease lapse whenever one took longer than a TTL (issue 34)."""
        with self._keeper_lock:
            self._keeper_generation += 1
            generation = self._keeper_generation
            old, self._keeper_client = self._keeper_client, client
            thread = threading.Thread(
                target=_keep_alive,
                args=(weakref.ref(self), self.stop, client, generation),
                name=f"etcd-v3-lease-{self._node}",
                daemon=True,
            )
            self._keeper_thread = thread
        thread.start()
        if old is not None:
            old.close()

    def revive_keeper_if_stalled(self, why: str) -> bool:
        """Replace the keeper by one on a new connection if it has had no answer from etcd
        for half a TTL while etcd answers this node (``why``: how we know). Seen in the e2e
        etcd-loss test: after the job's etcd pod was replaced, an agent's keeper never
        refreshed again and logged nothing, so each lease its joins took lapsed a TTL later
        and its peers dropped it over and over. Its stack is logged: where it is stuck."""
        with self._revive_lock:
            silent_for = time.monotonic() - self._answered_at
            if self.stop.is_set() or not keeper_cut_off(silent_for, self.granted_ttl):
                return False  # it left, or it answers (five times per TTL when etcd does)
            self._answered_at = time.monotonic()  # one revival per half TTL at most
        thread = self._keeper_thread
        frame = sys._current_frames().get(thread.ident) if thread and thread.ident else None
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(not running)\n"
        log.warning(
            "etcd-v3: %s: the lease keeper had no answer from etcd for %.1fs although etcd "
            "answers this node (%s); starting a new one on a new connection. The old "
            "keeper's stack:\n%s",
            self._node,
            silent_for,
            why,
            stack,
        )
        timing = keep_alive_timing(max(self.granted_ttl, 1))
        client = self._client.another(timing.timeout, timing.interval)
        self._start_keeper(client)
        return True

    def announce(self) -> None:
        """Take a fresh member lease and announce this node under it."""
        with self._lock:
            self._announce()

    def rejoin(self, lapsed: int | None = None) -> None:
        """The member lease lapsed (``lapsed``: its id where known): announce this node
        again, unless another thread already has, or it lapsed too often
        (:func:`leaves_after_lapse`): then the node gives up its place for good and
        :class:`MembershipGivenUp` says why. Without that bound a node that cannot hold
        its lease regrouped the whole job every TTL and a half, for ever (issue 34)."""
        with self._lock:
            if self.stop.is_set():
                return  # the node left: its key went with the revoked lease, for good
            if self.given_up is not None:
                raise MembershipGivenUp(self.given_up)
            if lapsed is None:
                kv = self._client.get(self._keys.member(self._node))
                if kv is not None and kv.lease == self.member_lease:
                    return  # announced again meanwhile (the keeper, a join)
            elif lapsed != self.member_lease:
                return  # announced again meanwhile
            now = time.monotonic()
            # the same lapse found again (the keeper's next turn, the watch) after an
            # announcement that failed (etcd still coming back) is not a second one
            if self.member_lease not in self._lapsed_leases:
                self._lapsed_leases.add(self.member_lease)
                self._lapsed_at = [t for t in self._lapsed_at if now - t <= LAPSE_WINDOW_S]
                self._lapsed_at.append(now)
            if leaves_after_lapse(tuple(self._lapsed_at), now):
                self.given_up = lapses_message(self._node, len(self._lapsed_at), self._client.where)
                log.error("etcd-v3: %s", self.given_up)
                raise MembershipGivenUp(self.given_up)
            self._announce()

    def _announce(self) -> None:
        """:meth:`announce`, with ``_lock`` held."""
        lease = self._client.grant_lease(self._lease_ttl)
        if lease.ttl != self.granted_ttl:  # the first time (or another etcd's minimum)
            self.granted_ttl = lease.ttl
            level, message = granted_ttl_message(self._lease_ttl, lease.ttl, self._client.where)
            log.log(level, "etcd-v3: %s", message)
        self.member_lease = lease.id
        port = self._liveness.port if self._liveness is not None else None
        member = Member(addr=self._addr, pid=os.getpid(), port=port, ttl=lease.ttl)
        value = encode_member(member)
        self._client.put(self._keys.member(self._node), value, lease=self.member_lease)

    def keep_alive(self, client: EtcdClient | None = None, generation: int | None = None) -> None:
        """Refresh the member lease once (through ``client``, the keeper's connection),
        and the run's lease when it is due; take new ones where etcd has lost them.
        ``generation``: the keeper's; a replaced keeper acts on nothing it learns."""
        via = client or self._client
        asked, previous = time.monotonic(), self._refreshed_at
        self._refreshed_at = None  # until this refresh has worked
        lease = self.member_lease
        lost = not via.refresh(lease)
        if generation is not None and generation != self._keeper_generation:
            return  # replaced while its call was under way
        self._answered_at = time.monotonic()
        if lost and self.stop.is_set():
            return  # revoked by leave (which stops this first): do not come back
        if lost and lease != self.member_lease:
            lost = False  # a join took a new lease meanwhile: that one is refreshed next
        if lost:
            log.warning("etcd-v3: node %s lost its lease; registering again", self._node)
            self.rejoin(lease)
        done = time.monotonic()
        if previous is not None and not lost:
            self._tell_if_late(done - previous, done)
        self._refreshed_at = done
        if not job_lease_due(asked - self._job_refreshed_at, lost):
            return
        job_lease = self.job_lease
        if not via.refresh(job_lease):
            # etcd lost the run's lease (a new etcd pod on an empty volume): every write
            # under it would fail with "requested lease not found" for ever
            self.replace_job_lease(job_lease)
        self._job_refreshed_at = asked

    def _tell_if_late(self, gap: float, now: float) -> None:
        """Failures in between are reported as such; a late refresh after a working one
        means this thread (or etcd) did not get to run in time."""
        late = late_refresh_warning(gap, self.granted_ttl, now - self._warned_late_at)
        if late is not None:
            self._warned_late_at = now
            log.warning("etcd-v3: %s: %s", self._node, late)

    def take_job_lease(self) -> None:
        """A new run lease, which the round key and the rounds' stores are written under."""
        self.job_lease = self._client.grant(self._job_ttl)
        self._on_job_lease(self.job_lease)

    def replace_job_lease(self, lost: int) -> int:
        """etcd no longer knows the run's lease ``lost`` (it lost its data): the run's
        lease to write under now, a new one unless another thread took one already (the
        keeper, a join and a round's store may each find it gone)."""
        with self._job_lock:
            if lost == self.job_lease:
                log.warning(
                    "etcd-v3: the run's lease is gone (etcd lost its data?); taking a new one"
                )
                self.take_job_lease()
            return self.job_lease

    def renew_member(self, why: str) -> None:
        """etcd answers this node but its member lease is gone: a new one now, the run's
        lease checked (etcd may have lost it too, as the keeper's rule says: a round's
        store is written under it, and its writes would be refused), and a new keeper if
        the old one has stopped answering (it should have done all this itself).

        A keeper stuck since etcd lost our leases may still look fine here: etcd came back
        before it had been silent for half a TTL. Look again when a working one would
        have answered, before the new member lease runs out.

        :class:`MembershipGivenUp` if the node lost its lease too often to come back."""
        self.rejoin()
        job_lease = self.job_lease
        if not self._client.refresh(job_lease):
            self.replace_job_lease(job_lease)
        if not self.revive_keeper_if_stalled(why):
            recheck = threading.Timer(
                keeper_recheck_after(self.granted_ttl), self.revive_keeper_if_stalled, (why,)
            )
            recheck.daemon = True
            recheck.start()

    def renew(self, why: str) -> None:
        """A write failed because etcd does not know a lease of ours: a new member lease,
        and a new run lease if etcd lost that one too (:meth:`renew_member`)."""
        log.warning("etcd-v3: %s: %s; taking new leases", self._node, why)
        self.renew_member(why)

    def leave(self) -> None:
        """Stop the keeper and revoke the member lease, so peers learn at once, not after
        the TTL. A rejoin under way (the round watch or a join that saw the key go) ends
        first and the lease it took is the one revoked; any later one sees ``stop`` and
        announces nothing: else the node's key came back after it left (a flaky test)."""
        self.stop.set()
        locked = self._lock.acquire(timeout=5.0)  # bounded: never wait on a stuck etcd call
        try:
            lease = self.member_lease
        finally:
            if locked:
                self._lock.release()
        try:
            if lease:  # else never started: nothing to drop
                self._client.revoke(lease)
        except EtcdError as exc:
            log.warning("etcd-v3: could not revoke the lease of %s: %s", self._node, exc)
        finally:
            if self._liveness is not None:
                self._liveness.close()  # after the revoke: probes then see no member key


def _keep_alive(
    ref: weakref.ref[LeaseHolder],
    stop: threading.Event,
    client: EtcdClient,
    generation: int,
) -> None:
    """Refresh the leases five times per TTL (``client`` is closed on the way out); exits
    when the holder is gone, has left or given up its place, or has a newer keeper
    (``generation``).

    Through ``client``, the keeper's own connection, once it is open; until then, and at
    once after a refresh over it failed, through the node's main connection (the one the
    round watch and the joins use). So a new connection that is slow to open (seen on
    kind during a scale-up, for seconds) or one that died costs no lease while etcd still
    answers the node: a keeper that waited for its own lost the lease each time.

    Nothing else in an agent holds the GIL for long (torch's agent loop sleeps between
    monitor ticks, etcd calls and process waits release it), so this thread runs on time
    unless the whole process is starved of CPU, which ``keep_alive`` then reports.
    """
    failure_told: float | None = None  # when a failure was last logged; None: working
    opening_since = time.monotonic()
    slow_told = False  # said that its own connection is slow to open
    try:
        while True:
            holder = ref()
            if (
                holder is None
                or holder._keeper_generation != generation
                or holder.given_up is not None
            ):
                return
            interval = keep_alive_timing(holder.granted_ttl).interval
            own = client.connected()
            waited = time.monotonic() - opening_since
            if not own and not slow_told and waited > max(holder.granted_ttl, 1):
                slow_told = True
                log.warning(
                    "etcd-v3: %s: the lease keeper's own connection to etcd at %s is not "
                    "open after %.1fs; it refreshes the leases over the node's main "
                    "connection meanwhile (new connections from this pod to etcd are slow: "
                    "a starved node, or its network rules being rewritten?)",
                    holder._node,
                    client.where,
                    waited,
                )
            elif own and slow_told:
                slow_told = False
                log.info("etcd-v3: the lease keeper's own connection opened after %.1fs", waited)
            try:
                try:
                    holder.keep_alive(client if own else None, generation)
                except EtcdError:
                    if not own:
                        raise
                    holder.keep_alive(None, generation)  # the main connection may answer
                if failure_told is not None:
                    log.info("etcd-v3: lease keep-alive works again")
                failure_told = None
            except MembershipGivenUp:
                return  # said once, where it was decided
            except Exception as exc:  # keep trying: a dead keeper would silently drop the node
                now = time.monotonic()
                if failure_told is None or now - failure_told >= KEEP_ALIVE_QUIET_S:
                    log.warning("etcd-v3: lease keep-alive failed (retrying): %s", exc)
                    failure_told = now
            del holder
            if stop.wait(interval):
                return
    finally:
        client.close()
