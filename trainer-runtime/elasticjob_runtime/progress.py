"""Training progress in etcd, for the operator to show in the job's status.

Global rank 0 publishes one JSON record under ``contract.progress_key(run_id)``:
step, samples/s, world size, restart count, and optionally the epoch and the newest
checkpoint step. The key is put with a lease that a background thread keeps alive,
so it goes away ``ttl`` seconds after the publishing process dies, and at once on
``close()``.

Publishing is throttled (``min_interval``) so a fast loop does not flood etcd.
Torch-free: the operator imports :func:`decode_progress` / :func:`read_progress`.

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

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from elasticjob_runtime import contract
from elasticjob_runtime.etcd_client import EtcdClient, EtcdError, parse_endpoints
from elasticjob_runtime.records import (
    MemoryFallback,
    Progress,
    decode_memory_fallback,
    decode_progress,
    encode_memory_fallback,
    encode_progress,
)

log = logging.getLogger(__name__)


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
    """Publishes one run's progress to etcd under a lease it keeps alive."""

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        *,
        world_size: int,
        restart_count: int = 0,
        ttl: int = 15,
        min_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl < 2:
            raise ValueError(f"ttl must be at least 2 seconds (got {ttl})")
        self.client = client
        self.key = contract.progress_key(run_id)
        self.ttl = ttl
        self.min_interval = min_interval
        self._clock = clock
        self._rate = SampleRate()
        self._last_publish: float | None = None
        self._lock = threading.Lock()
        self._current = Progress(
            step=0,
            samples_per_second=0.0,
            world_size=world_size,
            restart_count=restart_count,
            updated=time.time(),
        )
        self._lease = client.grant(ttl)
        self._stop = threading.Event()
        self._keeper = threading.Thread(target=self._keep_alive, name="progress-lease", daemon=True)
        self._keeper.start()

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
    ) -> bool:
        """Record a finished step of ``samples`` samples (all ranks); publish if due.

        Returns True when this call wrote to etcd. An etcd error is logged, not
        raised: progress is for display and must never stop training.
        """
        now = self._clock()
        rate = self._rate.add(samples, now)
        changes: dict[str, Any] = {"step": step, "samples_per_second": rate}
        if epoch is not None:
            changes["epoch"] = epoch
        if checkpoint_step is not None:
            changes["checkpoint_step"] = checkpoint_step
        if world_size is not None:
            changes["world_size"] = world_size
        self._current = replace(self._current, **changes)
        if self._last_publish is not None and now - self._last_publish < self.min_interval:
            return False
        self._last_publish = now
        return self.publish()

    def publish(self) -> bool:
        """Write the current record now; False (and one log line) if etcd refused."""
        with self._lock:
            self._current = replace(self._current, updated=time.time())
            try:
                self.client.put(self.key, encode_progress(self._current), lease=self._lease)
                return True
            except EtcdError as exc:
                log.warning("progress not published: %s", exc)
                return False

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                if self.client.refresh(self._lease):
                    continue
                # the lease expired (etcd was away longer than ttl): start a new one
                with self._lock:
                    self._lease = self.client.grant(self.ttl)
                self.publish()
            except EtcdError as exc:
                log.warning("progress lease keep-alive failed: %s", exc)

    def close(self) -> None:
        """Stop publishing and remove the record at once (revoking its lease)."""
        self._stop.set()
        self._keeper.join(timeout=self.ttl)
        try:
            self.client.revoke(self._lease)
        except EtcdError as exc:
            log.warning("progress lease not revoked (the key expires by itself): %s", exc)


def read_progress(client: EtcdClient, run_id: str) -> Progress | None:
    """The run's latest published progress, or None if nothing is published (or it expired)."""
    kv = client.get(contract.progress_key(run_id))
    return decode_progress(kv.value) if kv is not None else None


def progress_published(client: EtcdClient, run_id: str) -> Callable[[], bool]:
    """A readiness check for a health server outside the workers (e.g. in the agent):
    ready while the run's rank 0 has a progress record, i.e. training has started."""

    def check() -> bool:
        try:
            return read_progress(client, run_id) is not None
        except (EtcdError, ValueError, KeyError):
            return False

    return check


def run_id_from_env() -> str | None:
    return os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get(contract.RDZV_ID)


def reporter_from_env(*, ttl: int = 15, min_interval: float = 1.0) -> ProgressReporter | None:
    """A reporter on global rank 0 of a job with an etcd endpoint, else None.

    Reads ``PET_RDZV_ENDPOINT``, the run id (``TORCHELASTIC_RUN_ID`` / ``PET_RDZV_ID``),
    ``WORLD_SIZE``, ``TORCHELASTIC_RESTART_COUNT``; ``ELASTICJOB_PROGRESS=0`` turns it off.
    If etcd cannot be reached it logs one line and returns None: training goes on.
    """
    if os.environ.get(contract.PROGRESS, "1") == "0" or int(os.environ.get("RANK", "0")) != 0:
        return None
    endpoint, run_id = os.environ.get(contract.RDZV_ENDPOINT), run_id_from_env()
    if not endpoint or not run_id:
        return None
    client = EtcdClient(parse_endpoints(endpoint, contract.DEFAULT_ETCD_PORT))
    try:
        return ProgressReporter(
            client,
            run_id,
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            ttl=ttl,
            min_interval=min_interval,
        )
    except EtcdError as exc:
        log.warning("progress reporting off: %s", exc)
        client.close()
        return None


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


def read_memory_fallbacks(client: EtcdClient, run_id: str) -> list[MemoryFallback]:
    """Every pod's report in the run, by pod name."""
    items = client.snapshot(contract.memory_fallback_prefix(run_id)).items
    return [decode_memory_fallback(items[key].value) for key in sorted(items)]


def memory_fallback_reporter_from_env(
    timeout: float = 2.0,
) -> Callable[[MemoryFallback], None] | None:
    """Where a worker reports a failed node-memory copy: the run's etcd, from the same
    variables as :func:`reporter_from_env` (any rank), or None without an etcd endpoint
    (c10d, or not launched by elasticjob-run/torchrun) or with ``ELASTICJOB_PROGRESS=0``.
    Reporting never raises: it logs one line if etcd cannot be reached."""
    endpoint, run_id = os.environ.get(contract.RDZV_ENDPOINT), run_id_from_env()
    backend = os.environ.get(contract.RDZV_BACKEND, contract.DEFAULT_RDZV_BACKEND)
    if os.environ.get(contract.PROGRESS, "1") == "0" or backend == "c10d":
        return None
    if not endpoint or not run_id:
        return None
    try:
        address = parse_endpoints(endpoint, contract.DEFAULT_ETCD_PORT)
    except ValueError as exc:
        log.warning("node-memory fallbacks not reported: %s", exc)
        return None
    run = run_id

    def report(fallback: MemoryFallback) -> None:
        try:
            client = EtcdClient(address, timeout=timeout)
            try:
                report_memory_fallback(client, run, fallback)
            finally:
                client.close()
        except EtcdError as exc:
            log.warning("node-memory fallback not reported to the operator: %s", exc)

    return report
