"""Training progress in etcd, for the operator to show in the job's status.

Global rank 0 publishes one JSON record under ``contract.progress_key(run_id)``:
step, samples/s, world size, restart count, and optionally the epoch and the newest
checkpoint step. The key is put with a lease, so it goes away ``ttl`` seconds after the
publishing process dies, and at once on ``close()``.

Progress is for display and must never delay training: ``update()`` only records the
newest value; a background thread connects, grants and keeps the lease and publishes
(at most every ``min_interval``), so an etcd that is slow or away costs the training
loop nothing. :func:`progress_target` decides once where progress goes, for the
reporter and for the node-memory reports below alike: an etcd, never a c10d store.

A reporter sends etcd nothing before its first ``update()``, and counts samples per
second from when it was made. After a regroup or a restart a new reporter takes over the
record of a running job; a placeholder (step 0) or a rate without a base (0 samples/s)
would show in the job's status as progress lost, and it was not. And a script forks its
DataLoader's workers right after ``Run()``: a fork during a gRPC call can abort the
child (:meth:`ProgressReporter._await_first_step`). Later forks (a plain DataLoader forks
every epoch) wait for the publisher's call in flight (:mod:`.fork_gate`).

Besides, every node's memory writer (local rank 0, not only global rank 0) reports a
node-memory checkpoint copy that failed under ``contract.memory_fallback_key(run_id,
pod)`` (:func:`report_memory_fallback`, called by the CheckpointManager): the operator
says so once in the job's events, so a /dev/shm too small for the model is not silent.

In a training script::

    reporter = reporter_from_env()                      # None except on rank 0
    ...
    if reporter:
        reporter.update(step, samples=world * batch, epoch=epoch)
    ...
    if reporter:
        reporter.close()
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from elasticjob_runtime import contract
from elasticjob_runtime.etcd.client import EtcdClient, EtcdError
from elasticjob_runtime.etcd.endpoints import Endpoint, parse_endpoints
from elasticjob_runtime.etcd.fork_gate import CALL_TIMEOUT_S, CALLS
from elasticjob_runtime.etcd.records import (
    Divergence,
    MemoryFallback,
    Progress,
    decode_progress,
    encode_divergence,
    encode_memory_fallback,
    encode_progress,
)
from elasticjob_runtime.etcd.tls import EtcdTLS, open_client, tls_settings
from elasticjob_runtime.goodput.ledger import Ledger
from elasticjob_runtime.goodput.ledger import encode as encode_ledger

# A goodput ledger, or a function that returns the newest (called in the publisher thread).
LedgerSource = Ledger | Callable[[], Ledger]

log = logging.getLogger(__name__)

# After a failed etcd request, the publisher tries again after this many seconds.
RETRY_S = 1.0


class SampleRate:
    """Samples per second over a sliding window of ``window`` seconds."""

    def __init__(self, window: float = 10.0) -> None:
        self.window = window
        self.total = 0
        self._points: deque[tuple[float, int]] = deque()

    def add(self, samples: int, now: float) -> float:
        """Count ``samples`` done at time ``now``; return the current rate."""
        self.total += samples
        self._points.append((now, self.total))
        while len(self._points) > 2 and now - self._points[1][0] >= self.window:
            self._points.popleft()
        return self.rate()

    def rate(self) -> float:
        if len(self._points) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._points[0], self._points[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


class ProgressReporter:
    """Publishes one run's progress to etcd from a background thread, under a lease it
    keeps alive; the training thread only calls :meth:`update`."""

    def __init__(
        self,
        etcd: Sequence[Endpoint],
        run_id: str,
        *,
        tls: EtcdTLS | None = None,
        world_size: int,
        restart_count: int = 0,
        ttl: int = 15,
        min_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl < 2:
            raise ValueError(f"ttl must be at least 2 seconds (got {ttl})")
        self.key = contract.progress_key(run_id)
        self._ledger_key = contract.ledger_key(run_id)
        self._ledger: LedgerSource | None = None  # the goodput ledger handed over
        self.ttl = ttl
        self.min_interval = min_interval
        self._clock = clock
        self._rate = SampleRate()
        self._rate.add(0, clock())  # the base: the first update's rate is not 0
        self._current = Progress(
            step=0,
            samples_per_second=0.0,
            world_size=world_size,
            restart_count=restart_count,
            updated=time.time(),
        )
        self._placeholder = self._current  # what no update has touched: never published
        self._changed = threading.Event()
        self._stop = threading.Event()
        # Creating the client connects nothing (gRPC connects on the first request, in
        # the publisher, after the first step). No request outlasts a lease refresh
        # interval, and after an etcd restart the connection is tried again that often.
        # A TLS file that cannot be read raises here, at once (EtcdError, one line).
        self._client = open_client(
            etcd, tls, timeout=min(CALL_TIMEOUT_S, ttl / 3), reconnect_within=ttl / 3
        )
        self._publisher = threading.Thread(
            target=self._publish_loop, name="progress-publisher", daemon=True
        )
        self._publisher.start()
        # A rank 0 stopped by a signal (its group restarts) that leaves through SystemExit,
        # not close(), still publishes its newest ledger, which the next group takes on
        # (one that ends by os._exit, as a SIGTERM save in a broken group does, cannot:
        # the next group then takes the ledger published up to a second before).
        atexit.register(_close_at_exit, weakref.ref(self))

    @property
    def current(self) -> Progress:
        return self._current

    def update(
        self,
        step: int,
        samples: int,
        *,
        epoch: int | None = None,
        checkpoint_step: int | None = None,
        world_size: int | None = None,
        checkpoint_error: str | None = None,
        ledger: LedgerSource | None = None,
    ) -> None:
        """Record a finished step of ``samples`` samples (all ranks); never waits for etcd.

        ``checkpoint_error`` is the failed save's line, if the newest failed (else cleared).
        ``ledger``: the run's goodput ledger (goodput/ledger.py), or a function that
        returns the newest, read and encoded only when it is published (with the record
        and, every :data:`LEDGER_EVERY_S`, under a key that outlives it), in the
        background: never in a step."""
        rate = self._rate.add(samples, self._clock())
        changes: dict[str, Any] = {
            "step": step,
            "samples_per_second": rate,
            "checkpoint_error": checkpoint_error,
        }
        if epoch is not None:
            changes["epoch"] = epoch
        if checkpoint_step is not None:
            changes["checkpoint_step"] = checkpoint_step
        if world_size is not None:
            changes["world_size"] = world_size
        if ledger is not None:
            self._ledger = ledger
        self._current = replace(self._current, **changes)
        self._changed.set()

    def update_ledger(self, ledger: LedgerSource) -> None:
        """The goodput ledger moved on without a step (the run ends): published with the
        record, if a step has been (a record that never had one is never published)."""
        if self._current is not self._placeholder:
            self._ledger = ledger
            self._current = replace(self._current)  # a new record: published again
            self._changed.set()

    def close(self, wait: float = 2.0) -> None:
        """Stop publishing and remove the record (revoking its lease), waiting at most
        ``wait`` seconds for that; an etcd that does not answer lets the key expire."""
        self._stop.set()
        self._changed.set()
        self._publisher.join(timeout=wait)

    def _await_first_step(self) -> None:
        """No request before the first step (none is published before it anyway). A
        script forks its DataLoader's workers right after ``Run()``; a fork while this
        thread is inside a gRPC call makes gRPC skip its fork handlers, and the child can
        abort (a loader worker died of ``Check failed: next_worker->state == KICKED``
        when this thread's lease grant was in flight, on a loaded CI machine)."""
        while self._current is self._placeholder and not self._stop.is_set():
            self._changed.wait()
            self._changed.clear()

    def _publish_loop(self) -> None:
        """Grant the lease, put each new record (throttled), refresh the lease; until
        ``close``, then revoke. etcd errors are logged once until it works again."""
        lease: int | None = None
        published: Progress | None = None  # the record last put under ``lease``
        put_at = refresh_at = -math.inf
        failing = False
        ledger = LedgerKey(self._client, self._ledger_key)
        self._await_first_step()
        try:
            while not self._stop.is_set():
                self._changed.clear()
                current = self._current
                try:
                    with CALLS:  # a fork meanwhile waits for them (fork_gate.py)
                        now = self._clock()
                        if lease is None:
                            lease, published, refresh_at = self._client.grant(self.ttl), None, now
                        elif now - refresh_at >= self.ttl / 3:
                            if not self._client.refresh(lease):
                                lease = None  # expired while etcd was away: a new one, put again
                                continue
                            refresh_at = now
                        pending = current is not published and current is not self._placeholder
                        if pending and now - put_at >= self.min_interval:
                            book = _encoded(self._ledger)
                            record = replace(current, updated=time.time(), ledger=book)
                            self._client.put(self.key, encode_progress(record), lease=lease)
                            published, put_at, pending = current, now, False
                            ledger.keep(book, now)
                except EtcdError as exc:
                    if not failing:
                        log.warning("progress not published (retrying in the background): %s", exc)
                    failing = True
                    self._stop.wait(RETRY_S)
                    continue
                if failing:
                    log.info("progress publishing works again")
                    failing = False
                until_refresh = refresh_at + self.ttl / 3 - self._clock()
                if pending:  # throttled: nothing to wake up for but the end
                    self._stop.wait(min(until_refresh, put_at + self.min_interval - self._clock()))
                else:
                    self._changed.wait(until_refresh)
            with CALLS:
                if self._current is not self._placeholder and self._ledger is not None:
                    ledger.keep(_encoded(self._ledger), self._clock(), force=True)  # the newest
                if lease is not None:
                    self._client.revoke(lease)
        except EtcdError as exc:
            log.warning("progress lease not revoked (the key expires by itself): %s", exc)
        finally:
            with CALLS:
                self._client.close()


def _close_at_exit(ref: weakref.ref[ProgressReporter]) -> None:
    reporter = ref()
    if reporter is not None:
        reporter.close()


def _encoded(source: LedgerSource | None) -> dict[str, Any] | None:
    if source is None:
        return None
    return encode_ledger(source() if callable(source) else source)


# How often rank 0 also puts the ledger under its own key (and once more when it stops);
# the progress record carries it every second, but goes with its 15 s lease.
LEDGER_EVERY_S = 5.0
# The ledger key's lease: a group that restarts within it takes the ledger on.
LEDGER_TTL_S = 3600


class LedgerKey:
    """The ledger under :func:`contract.ledger_key`, every :data:`LEDGER_EVERY_S`, on a
    lease of its own (:data:`LEDGER_TTL_S`), so that a group that restarts after the
    progress record expired still takes it on (goodput/keeper.py reads it back)."""

    def __init__(self, client: EtcdClient, key: str) -> None:
        self._client = client
        self._key = key
        self._lease: int | None = None
        self._granted_at = -math.inf
        self._put_at = -math.inf

    def keep(self, ledger: dict[str, Any] | None, now: float, force: bool = False) -> None:
        if ledger is None or (not force and now - self._put_at < LEDGER_EVERY_S):
            return
        if self._lease is None or now - self._granted_at >= LEDGER_TTL_S / 3:
            # a new lease, rather than refreshes: the old one ends by itself
            self._lease, self._granted_at = self._client.grant(LEDGER_TTL_S), now
        self._client.put(self._key, json.dumps(ledger, sort_keys=True).encode(), lease=self._lease)
        self._put_at = now


def published_ledger(client: EtcdClient, run_id: str) -> dict[str, Any] | None:
    """The newest ledger a rank 0 of this run published: from the progress record, else
    from the ledger key (the one with the later ``through``); None if neither holds one."""
    found: list[dict[str, Any]] = []
    record = client.get(contract.progress_key(run_id))
    if record is not None:
        with contextlib.suppress(ValueError):
            if (ledger := decode_progress(record.value).ledger) is not None:
                found.append(ledger)
    kept = client.get(contract.ledger_key(run_id))
    if kept is not None:
        with contextlib.suppress(ValueError):
            if isinstance(doc := json.loads(kept.value), dict):
                found.append(doc)
    through = [
        (float(d["through"]), i)
        for i, d in enumerate(found)
        if isinstance(d.get("through"), int | float)
    ]
    return found[max(through)[1]] if through else None


@dataclass(frozen=True)
class ProgressTarget:
    """The run's etcd, where progress and node-memory reports go."""

    etcd: tuple[Endpoint, ...]
    run_id: str
    tls: EtcdTLS | None = None  # from the endpoint's scheme and ELASTICJOB_ETCD_*


@dataclass(frozen=True)
class Nowhere:
    """No progress is published, and why (one line; ``bad_input`` for a config mistake)."""

    why: str
    bad_input: bool = False


def progress_target(env: Mapping[str, str]) -> ProgressTarget | Nowhere:
    """Where this process publishes progress, decided from its environment alone.

    ``ELASTICJOB_PROGRESS_ENDPOINT`` if set (``elasticjob-run`` sets it to the etcd it
    rendezvouses on: its flags win over the environment, so only it knows), else
    ``PET_RDZV_ENDPOINT`` when ``PET_RDZV_BACKEND`` is an etcd one; never a c10d store,
    which would not answer etcd's protocol. ``ELASTICJOB_PROGRESS=0`` turns it off.
    """
    if env.get(contract.PROGRESS, "1").strip() == "0":
        return Nowhere(f"{contract.PROGRESS}=0")
    run_id = env.get("TORCHELASTIC_RUN_ID") or env.get(contract.RDZV_ID)
    if not run_id:
        return Nowhere(f"no run id (TORCHELASTIC_RUN_ID or {contract.RDZV_ID})")
    named, text = contract.PROGRESS_ENDPOINT, env.get(contract.PROGRESS_ENDPOINT, "").strip()
    if not text:
        backend = env.get(contract.RDZV_BACKEND, "").strip()
        if backend not in contract.ETCD_RDZV_BACKENDS:
            return Nowhere(
                f"the rendezvous ({contract.RDZV_BACKEND}={backend or 'unset'}) is not an "
                f"etcd; set {contract.PROGRESS_ENDPOINT} to an etcd to publish progress"
            )
        named, text = contract.RDZV_ENDPOINT, env.get(contract.RDZV_ENDPOINT, "").strip()
        if not text:
            return Nowhere(f"no etcd endpoint ({contract.RDZV_ENDPOINT} is not set)")
    try:
        etcd = parse_endpoints(text, contract.DEFAULT_ETCD_PORT)
        tls = tls_settings(text, {}, env)
    except ValueError as exc:
        return Nowhere(f"{named}: {exc}", bad_input=True)
    return ProgressTarget(tuple(etcd), run_id, tls)


def _target_from_env(what: str) -> ProgressTarget | None:
    target = progress_target(os.environ)
    if isinstance(target, Nowhere):
        log.log(
            logging.WARNING if target.bad_input else logging.INFO, "%s off: %s", what, target.why
        )
        return None
    return target


def reporter_from_env(*, ttl: int = 15, min_interval: float = 1.0) -> ProgressReporter | None:
    """A reporter on global rank 0 when :func:`progress_target` names an etcd, else None.

    Also reads ``WORLD_SIZE`` and ``TORCHELASTIC_RESTART_COUNT``. Returns at once: an
    etcd that cannot be reached is logged (once) by the reporter's thread.
    """
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    target = _target_from_env("progress reporting")
    if target is None:
        return None
    try:
        return ProgressReporter(
            target.etcd,
            target.run_id,
            tls=target.tls,
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            ttl=ttl,
            min_interval=min_interval,
        )
    except EtcdError as exc:
        log.warning("progress reporting off: %s", exc)
        return None


def reporter_for_rank(rank: int, current: ProgressReporter | None) -> ProgressReporter | None:
    """Global rank 0 publishes progress; after a regroup that may be another process."""
    if rank == 0 and current is None:
        return reporter_from_env()
    if rank != 0 and current is not None:
        current.close(wait=0)  # the new rank 0 publishes; training goes on now
        return None
    return current


# -- node-memory checkpoint copies that failed ------------------------------------------

# The report outlives its writer (the operator must see it even if the pod dies at once)
# but not the run's etcd for ever: an hour is many operator resyncs.
MEMORY_FALLBACK_TTL = 3600


def report_memory_fallback(
    client: EtcdClient, run_id: str, report: MemoryFallback, ttl: int = MEMORY_FALLBACK_TTL
) -> None:
    """Put the report under the run's prefix, on a lease of ``ttl`` seconds (not kept alive)."""
    lease = client.grant(ttl)
    client.put(
        contract.memory_fallback_key(run_id, report.pod), encode_memory_fallback(report), lease
    )


def memory_fallback_reporter_from_env(
    timeout: float = 2.0, connect_within: float = 10.0
) -> Callable[[MemoryFallback], None] | None:
    """Where a worker (any rank) reports a failed node-memory copy (see
    :func:`record_reporter_from_env`)."""
    return record_reporter_from_env(
        "node-memory fallback", report_memory_fallback, timeout, connect_within
    )


Record = TypeVar("Record")


def record_reporter_from_env(
    what: str,
    put: Callable[[EtcdClient, str, Record], None],
    timeout: float = 2.0,
    connect_within: float = 10.0,
) -> Callable[[Record], None] | None:
    """Where a worker (any rank) records something for the operator: ``put`` into the
    run's etcd, as :func:`progress_target` decides, or None. Reporting never raises: it
    logs one line if etcd cannot be reached (after at most about ``connect_within`` plus
    two ``timeout`` seconds). The connection (DNS, TCP, the TLS handshake) has its own
    budget: on a busy cluster it alone took longer than a request's 2 s (seen on kind)."""
    target = _target_from_env(f"{what} reports")
    if target is None:
        return None

    def report(record: Record) -> None:
        try:
            client = open_client(target.etcd, target.tls, timeout=timeout)
            try:
                client.connect(connect_within)
                put(client, target.run_id, record)
            finally:
                client.close()
        except EtcdError as exc:
            log.warning("%s not reported to the operator: %s", what, exc)

    return report


# -- ranks that trained different models ------------------------------------------------


def report_divergence(
    client: EtcdClient, run_id: str, record: Divergence, ttl: int = MEMORY_FALLBACK_TTL
) -> None:
    """Put the record under the run's prefix, on a lease of ``ttl`` seconds."""
    lease = client.grant(ttl)
    client.put(contract.divergence_key(run_id, record.step), encode_divergence(record), lease)


def divergence_reporter_from_env() -> Callable[[Divergence], None] | None:
    """Where a worker records that the ranks disagreed (:func:`record_reporter_from_env`):
    the worker stops or resyncs whether or not the operator hears of it."""
    return record_reporter_from_env("divergence", report_divergence)
