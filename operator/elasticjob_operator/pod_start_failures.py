"""Worker pods the kubelet cannot start, said on the job itself, pure.

A worker whose container waits for ever (a Secret its env names is missing, an image the
node cannot pull, a crash loop) leaves its pod Pending, so without this the job only
says "0 of 2 workers running" and the reason sits on the pod. From the containers'
waiting reasons (:class:`~elasticjob_operator.observe.Waiting`) this decides the words
the Running condition adds (every worker waiting for a failure, now) and one
``WorkerStuck`` Warning per pod and reason, remembered in ``status.stuckWorkers`` while
that pod exists: a pod whose state flips between a retry and its back-off
(``ErrImagePull`` and ``ImagePullBackOff``, a crash loop's short runs) is warned about
once, and so is it after an operator restart.

The kubelet retries every one of these reasons for ever; what tells them apart is whether
a retry can help by itself:

* **stuck** (warned): the same attempt fails until someone changes something.
  ``CreateContainerConfigError`` (a Secret or ConfigMap, or a key of one, that the env
  names is missing), ``CreateContainerError`` (the runtime could not create the
  container: a bad mount, a name taken), ``ImagePullBackOff`` (pulls failed and the
  kubelet backs off), ``ErrImageNeverPull`` (``imagePullPolicy: Never`` and the image is
  not on the node), ``InvalidImageName`` (the reference does not parse),
  ``ImageInspectError`` (the image on the node is unreadable), ``CrashLoopBackOff`` (the
  container keeps exiting; for worker pods, whose ``restartPolicy`` is ``Never``, only a
  sidecar init container restarts).
* **transient** (named in the condition, not warned): one failed attempt that the next
  may not repeat. ``ErrImagePull`` (a registry hiccup; a second failure is
  ``ImagePullBackOff``), ``RunContainerError`` (a start that failed; a container that
  restarts goes on to ``CrashLoopBackOff``, a worker's main container ends
  ``StartError`` and the pod fails, which rule "Failed or vanished worker" handles),
  ``RegistryUnavailable``.
* anything else (``ContainerCreating``, ``PodInitializing``) is a pod starting normally.

The rule ("Stuck workers") is in docs/operator.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from elasticjob_operator import models
from elasticjob_operator.decision import Event, warning
from elasticjob_operator.observe import ObservedPod

REASON: Final = "WorkerStuck"

# what the user can do about each stuck reason
STUCK: Final = {
    "CreateContainerConfigError": "create the Secret or ConfigMap its env names, or fix the "
    "template; the kubelet retries",
    "CreateContainerError": "the container runtime could not create the container: fix "
    "the template",
    "ImagePullBackOff": "check the image name, the registry and imagePullSecrets",
    "ErrImageNeverPull": "the image is not on the node and imagePullPolicy is Never",
    "InvalidImageName": "fix the image name in the template",
    "ImageInspectError": "the image on the node cannot be read",
    "CrashLoopBackOff": "it keeps exiting: see kubectl logs --previous",
}
TRANSIENT: Final = frozenset({"ErrImagePull", "RunContainerError", "RegistryUnavailable"})
ACTIVE_PHASES: Final = frozenset({"Pending", "Running", "Unknown"})
MAX_NAMED: Final = 3  # pods the Running condition names; the rest are counted
MAX_REMEMBERED: Final = 20  # warnings held in status; more stuck pods are counted only
MAX_MESSAGE: Final = 300  # of the kubelet's message (an image pull's can run long)


@dataclass(frozen=True)
class StartFailure:
    """One worker pod whose container waits for a failure reason."""

    pod: str
    container: str
    reason: str
    message: str

    @property
    def stuck(self) -> bool:
        return self.reason in STUCK

    def describe(self) -> str:
        """``<pod>: <reason> (container <c>): <kubelet's message>``."""
        said = f"{self.pod}: {self.reason} (container {self.container})"
        return f"{said}: {self.message}" if self.message else said


def start_failure(pod: ObservedPod) -> StartFailure | None:
    """The pod's first container waiting for a failure reason, a stuck one before a
    transient one; None when none is (or the pod has ended or is being deleted)."""
    if pod.terminating or pod.phase not in ACTIVE_PHASES:
        return None
    failing = [w for w in pod.waiting if w.reason in STUCK or w.reason in TRANSIENT]
    failing.sort(key=lambda w: w.reason not in STUCK)  # stable: the pod's order within
    if not failing:
        return None
    w = failing[0]
    message = " ".join(w.message.split())
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 3] + "..."
    return StartFailure(pod.name, w.container, w.reason, message)


def summary(failures: Sequence[StartFailure]) -> str:
    """What the Running condition adds: the first pods described, the rest counted."""
    parts = [f.describe() for f in failures[:MAX_NAMED]]
    if len(failures) > MAX_NAMED:
        parts.append(f"and {len(failures) - MAX_NAMED} more waiting")
    return "; ".join(parts)


def event_message(failure: StartFailure) -> str:
    return f"worker pod {failure.describe()}; {STUCK[failure.reason]}"


@dataclass(frozen=True)
class StartFailures:
    remembered: tuple[models.StuckWorker, ...]  # status.stuckWorkers
    events: tuple[Event, ...]
    summary: str  # for the Running condition's message; "" when no worker waits


def decide_start_failures(
    remembered: Sequence[models.StuckWorker],
    pods: Iterable[ObservedPod],
    existing: frozenset[str],
    now: datetime,
) -> StartFailures:
    """Rule "Stuck workers": ``pods`` are the run's workers this round keeps, ``existing``
    the names of every worker pod observed (a warning is remembered while its pod is
    there). One Warning per stuck pod and reason not yet remembered."""
    ordered = sorted(pods, key=lambda p: p.index)
    failures = [f for p in ordered if (f := start_failure(p)) is not None]
    kept = [s for s in remembered if s.pod in existing]
    known = {(s.pod, s.reason) for s in kept}
    events = []
    for f in failures:
        if not f.stuck or (f.pod, f.reason) in known or len(kept) >= MAX_REMEMBERED:
            continue
        kept.append(
            models.StuckWorker(
                pod=f.pod, container=f.container, reason=f.reason, message=f.message, time=now
            )
        )
        known.add((f.pod, f.reason))
        events.append(warning(REASON, event_message(f)))
    return StartFailures(tuple(kept), tuple(events), summary(failures))
