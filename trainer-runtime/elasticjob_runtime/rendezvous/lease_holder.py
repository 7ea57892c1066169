"""A node's two leases and the thread that keeps them alive.

The member lease holds the node's member key (and its join keys): it is how peers learn
within a TTL that the node died or froze. The run's lease holds the round key, the
rounds' stores and the run records, so they outlive any one agent by ``job_ttl`` and
vanish with the job. The rules (timing, what to tell the user) are pure, in
:mod:`elasticjob_runtime.rendezvous.leases`; this is their I/O.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable

from elasticjob_runtime.etcd.client import EtcdClient, EtcdError
from elasticjob_runtime.rendezvous.keys import RendezvousKeys
from elasticjob_runtime.rendezvous.leases import (
    granted_ttl_message,
    job_lease_due,
    keep_alive_timing,
    late_refresh_warning,
)

log = logging.getLogger(__name__)

# While the keep-alive keeps failing (etcd down), say so once every this many seconds.
KEEP_ALIVE_QUIET_S = 5.0


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
        self._refreshed_at: float | None = None  # the last refresh, None after a failed one
        self._job_refreshed_at = 0.0
        self._warned_late_at = -math.inf

    def start(self) -> None:
        """Take both leases, announce the node and start the keeper thread.

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
        self.take_job_lease()
        self.announce()
        now = time.monotonic()
        self._refreshed_at = now
        self._job_refreshed_at = now
        keeper_client.timeout = keep_alive_timing(self.granted_ttl).timeout
        threading.Thread(
            target=_keep_alive,
            args=(weakref.ref(self), self.stop, keeper_client),
            name=f"etcd-v3-lease-{self._node}",
            daemon=True,
        ).start()

    def announce(self) -> None:
        """Take a fresh member lease and announce this node under it."""
        with self._lock:
            lease = self._client.grant_lease(self._lease_ttl)
            if lease.ttl != self.granted_ttl:  # the first time (or another etcd's minimum)
                self.granted_ttl = lease.ttl
                level, message = granted_ttl_message(self._lease_ttl, lease.ttl, self._client.where)
                log.log(level, "etcd-v3: %s", message)
            self.member_lease = lease.id
            value = json.dumps({"addr": self._addr, "pid": os.getpid()}).encode()
            self._client.put(self._keys.member(self._node), value, lease=self.member_lease)

    def keep_alive(self, client: EtcdClient | None = None) -> None:
        """Refresh the member lease once (through ``client``, the keeper's connection),
        and the run's lease when it is due; take new ones where etcd has lost them."""
        via = client or self._client
        asked, previous = time.monotonic(), self._refreshed_at
        self._refreshed_at = None  # until this refresh has worked
        lost = not via.refresh(self.member_lease)
        if lost and self.stop.is_set():
            return  # revoked by leave (which stops this first): do not come back
        if lost:
            log.warning("etcd-v3: node %s lost its lease; registering again", self._node)
            self.announce()
        done = time.monotonic()
        if previous is not None and not lost:
            self._tell_if_late(done - previous, done)
        self._refreshed_at = done
        if not job_lease_due(asked - self._job_refreshed_at, lost):
            return
        if not via.refresh(self.job_lease):
            # etcd lost the run's lease (a new etcd pod on an empty volume): every write
            # under it would fail with "requested lease not found" for ever
            log.warning("etcd-v3: the run's lease is gone (etcd lost its data?); taking a new one")
            self.take_job_lease()
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

    def renew(self, why: str) -> None:
        """A write failed because etcd does not know a lease of ours: take both anew."""
        log.warning("etcd-v3: %s: %s; taking new leases", self._node, why)
        self.announce()
        self.take_job_lease()

    def leave(self) -> None:
        """Stop the keeper and revoke the member lease, so peers learn at once, not after
        the TTL."""
        self.stop.set()
        if not self.member_lease:
            return  # never started: nothing to drop
        try:
            self._client.revoke(self.member_lease)
        except EtcdError as exc:
            log.warning("etcd-v3: could not revoke the lease of %s: %s", self._node, exc)


def _keep_alive(ref: weakref.ref[LeaseHolder], stop: threading.Event, client: EtcdClient) -> None:
    """Refresh the leases five times per TTL through ``client`` (closed on the way out);
    exits when the holder is gone or has left.

    Nothing else in an agent holds the GIL for long (torch's agent loop sleeps between
    monitor ticks, etcd calls and process waits release it), so this thread runs on time
    unless the whole process is starved of CPU, which ``keep_alive`` then reports.
    """
    failure_told: float | None = None  # when a failure was last logged; None: working
    try:
        while True:
            holder = ref()
            if holder is None:
                return
            interval = keep_alive_timing(holder.granted_ttl).interval
            try:
                holder.keep_alive(client)
                if failure_told is not None:
                    log.info("etcd-v3: lease keep-alive works again")
                failure_told = None
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
