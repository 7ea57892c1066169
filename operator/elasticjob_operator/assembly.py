"""The operator, assembled once at startup: the one object the kopf handlers hand their
work to.

It holds the API client, the jobs' etcd Secrets, the shared etcd's access (None without
one), the settings and the threads: the work queue that reconciles jobs, the deletions
of gone jobs' children, and the resync sweep. Nothing of it lives in module globals but
the one reference :mod:`elasticjob_operator.handlers` keeps to it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from elasticjob_operator import gang, job_round, metrics
from elasticjob_operator.deletions import Deletions
from elasticjob_operator.etcd.access import SharedAccess, open_shared
from elasticjob_operator.etcd.secrets import EtcdSecrets
from elasticjob_operator.kube import Kube, load_config
from elasticjob_operator.pod_watch import PodWatch
from elasticjob_operator.reconcile import Config
from elasticjob_operator.settings import Settings
from elasticjob_operator.workqueue import WorkQueue

log = logging.getLogger("elasticjob_operator")


class Operator:
    def __init__(
        self, settings: Settings, kube: Kube, secrets: EtcdSecrets, shared: SharedAccess | None
    ) -> None:
        self.settings = settings
        self.kube = kube
        self.secrets = secrets
        self.shared = shared
        self.queue = WorkQueue(
            lambda key, progress: job_round.reconcile_job(self, *key, progress), settings.workers
        )
        self.deletions = Deletions(self.delete_children)
        self.pods = PodWatch()  # what the pod watch knows that a listing cannot
        self.stopping = threading.Event()
        self.last_sweep = 0.0  # the liveness probe's: when the resync last listed the jobs

    @property
    def config(self) -> Config:
        return self.settings.config

    def start(self) -> None:
        if self.settings.metrics_port:
            metrics.serve(self.settings.metrics_port, self.settings.metrics_addr)
        self.queue.start()
        self.deletions.start()
        threading.Thread(target=self._sweep, name="elasticjob-resync", daemon=True).start()

    def stop(self) -> None:
        self.stopping.set()
        self.queue.stop()
        self.deletions.stop()

    def _namespaces(self) -> list[str] | None:
        return list(self.settings.namespaces) or None

    def _sweep(self) -> None:
        """The backstop: every job due, every resync_seconds, with progress and time rules."""
        while not self.stopping.is_set():
            try:
                jobs = self.kube.list_jobs(self._namespaces())
                metrics.set_phases((j.get("status") or {}).get("phase") or "Created" for j in jobs)
                for job in jobs:
                    m = job["metadata"]
                    self.queue.add((m["namespace"], m["name"]), read_progress=True)
                self.last_sweep = time.time()
            except Exception as exc:
                log.warning("resync failed: %s", exc)
            if self.shared is not None:
                try:
                    self._tend_shared_etcd(self.shared)
                except Exception as exc:  # the etcd not up yet, or busy: next resync
                    log.warning("shared etcd: %s", exc)
            self.stopping.wait(self.settings.resync_seconds)

    def _tend_shared_etcd(self, shared: SharedAccess) -> None:
        """Authentication on (again, if the etcd lost its data) and no user of a gone job."""
        users = shared.users
        if users.ensure_auth():
            log.info("shared etcd: authentication switched on; every job's user is added again")
        known = users.users()  # before the jobs: see EtcdUsers.remove_stale
        live = {j["metadata"]["uid"] for j in self.kube.list_jobs(self._namespaces())}
        for user in users.remove_stale(known, live):
            log.info("shared etcd: removed user %s (its job is gone)", user)

    def delete_children(self, namespace: str, uids: list[str]) -> None:
        """What a deleted job leaves: its children (a burst of deleted jobs' at once) and
        its shared etcd user, whose certificate then opens nothing."""
        try:
            self.kube.delete_children(namespace, uids)
        except Exception as exc:  # the garbage collector still removes them, only slower
            log.warning(
                "%s: deleting %d deleted jobs' children failed: %s", namespace, len(uids), exc
            )
        if self.shared is not None:
            for uid in uids:
                try:
                    self.shared.users.remove_job(uid)
                except Exception as exc:  # the resync's sweep removes it later
                    log.warning(
                        "%s: removing the etcd user of job %s failed: %s", namespace, uid, exc
                    )


def assemble(settings: Settings) -> Operator:
    """The operator's parts, connected: the API client (in a pod its ServiceAccount), the
    Secrets, the shared etcd's certificates (issued now if it has none) and users."""
    load_config()
    kube = Kube(
        network_policies=settings.config.network_policy is not None,
        kueue=settings.config.kueue,
    )
    served = settings.gang_mode is not gang.Mode.OFF and kube.serves(
        gang.API_VERSION, gang.RESOURCE
    )
    try:
        kube.gang = gang.enabled(settings.gang_mode, served)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    log.info(
        "gang placement by kube-scheduler (%s %s): %s for new jobs",
        gang.API_VERSION,
        gang.RESOURCE,
        "on" if kube.gang else f"off ({settings.gang_mode.value}, served: {served})",
    )
    settings = replace(settings, config=replace(settings.config, gang=kube.gang))
    secrets = EtcdSecrets(kube.rest)
    etcd = settings.config.shared_etcd
    shared = open_shared(secrets, etcd) if etcd is not None else None
    return Operator(settings, kube, secrets, shared)
