"""The example's training as the e2e tests watch it: its manifest with ``TRAIN_*`` values
changed, and every line of every worker pod of a job, followed from the moment each pod
runs (so pods a fault or a scale-down removes still count), read back as steps, resumes
and per-step sample records (``elasticjob_examples.sample_audit``)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import yaml
from elasticjob_examples import sample_audit
from kube_helpers import REPO, RUNTIME_IMAGE, Cluster, Obj, wait_for

from bench.pod_logs import PodLogs

MANIFEST = REPO / "examples" / "manifests" / "elastic.yaml"
JOB_LABEL = "elastic.pytorch.org/job-name"
ROLE_LABEL = "elastic.pytorch.org/replica-type"
TRAIN = 300.0  # generous bound for training phases (2 busy cores)


# -- what the example logs ----------------------------------------------------------------


def fields(line: str) -> dict[str, str]:
    return dict(tok.split("=", 1) for tok in line.split() if "=" in tok)


@dataclass(frozen=True)
class Step:
    """``step=N epoch=E loss=L world=W rank=R ... t=T`` (rank 0, every TRAIN_LOG_EVERY)."""

    step: int
    world: int
    loss: float
    t: float


@dataclass(frozen=True)
class Resume:
    """Rank 0 goes on after a change of the group: ``resumed from step N (...)`` or
    ``starting fresh`` when its process (re)started, ``regrouped at step N (...)`` when it
    stayed alive and regrouped in place. Which of the two rank 0 logs after a fault
    depends on which agent opened the next round (its worker gets rank 0)."""

    step: int
    world: int
    t: float


class Logs(PodLogs):
    """Every line of every worker pod of a job (bench.pod_logs), read back as the
    example's steps, resumes and sample records."""

    def __init__(self, c: Cluster, ns: str, job: str) -> None:
        self.c, self.job = c, job
        super().__init__(c.kubeconfig, c.core, ns, f"{JOB_LABEL}={job},{ROLE_LABEL}=worker")

    def steps(self) -> list[Step]:
        out = []
        for line in self.text():
            if line.startswith("step="):
                f = fields(line)
                out.append(Step(int(f["step"]), int(f["world"]), float(f["loss"]), float(f["t"])))
        return sorted(out, key=lambda s: s.t)

    def resumes(self) -> list[Resume]:
        out = []
        for line in self.text():
            if line.startswith(("resumed from step", "regrouped at step", "starting fresh")):
                f = fields(line)
                step = 0 if line.startswith("starting") else int(line.split()[3])
                out.append(Resume(step, int(f["world"]), float(f["t"])))
        return sorted(out, key=lambda r: r.t)

    def samples(self) -> list[sample_audit.Record]:
        return sample_audit.parse_all(self.text())

    def last_step(self) -> int:
        return max((s.step for s in self.steps()), default=0)


def manifest(name: str, replicas: int = 2, **env: Any) -> Obj:
    """examples/manifests/elastic.yaml, renamed, with these TRAIN_* values."""
    doc: Obj = yaml.safe_load(MANIFEST.read_text())
    doc["metadata"] = {"name": name}
    worker = doc["spec"]["replicaSpecs"]["Worker"]
    worker["replicas"] = replicas
    container = worker["template"]["spec"]["containers"][0]
    container["image"] = RUNTIME_IMAGE
    merged = {e["name"]: e["value"] for e in container.get("env", [])}
    merged["TRAIN_EPOCHS"] = "1000"  # TRAIN_STEPS decides the end
    merged.update({k: str(v) for k, v in env.items()})
    container["env"] = [{"name": k, "value": v} for k, v in merged.items()]
    # a node-local checkpoint per pod is the example's point; one request keeps a pod
    # per node schedulable on small clusters (kind)
    container["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"}}
    return doc


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:4]}"


def wait_step(logs: Logs, step: int, timeout: float = TRAIN, world: int | None = None) -> Step:
    """The first logged step >= ``step`` (at this world size, if given)."""

    def reached() -> Step | None:
        for s in logs.steps():
            if s.step >= step and (world is None or s.world == world):
                return s
        return None

    try:
        return wait_for(f"{logs.job} to log step {step} (world {world})", reached, timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{logs.tail()}") from None


def wait_world(logs: Logs, world: int, after: float, step: int = 0) -> Step:
    """The first step logged at ``world`` after ``after`` (unix time, at least ``step``);
    fails at once, saying so, if training ended first: then that world can never come."""

    def reached() -> Step | None:
        found = next(
            (s for s in logs.steps() if s.world == world and s.t > after and s.step >= step),
            None,
        )
        if found is None and any(line.startswith("ELASTICJOB_RESULT ") for line in logs.text()):
            last = logs.steps()[-1] if logs.steps() else None
            raise AssertionError(
                f"training ended ({last}) before world {world}: the job's step budget ran "
                f"out before the resize reached the workers\n{logs.tail()}"
            )
        return found

    return wait_for(f"{logs.job} to log a step at world {world}", reached, TRAIN)


# -- a test's jobs ------------------------------------------------------------------------


def delete_jobs(c: Cluster, job_ns: str) -> None:
    """Delete every job in ``job_ns`` and wait for their pods to go (freeing the cores)."""
    for j in c.list_jobs(job_ns):
        c.kubectl("-n", job_ns, "delete", "elasticjob", j["metadata"]["name"], "--wait=false")
    wait_for(
        "the previous jobs' pods to be gone",
        lambda: not c.core.list_namespaced_pod(job_ns, label_selector=JOB_LABEL).items,
    )


@contextmanager
def job_starter(c: Cluster, ns: str, tail: int | None = None) -> Iterator[Callable[[Obj], Logs]]:
    """Apply a job and follow its workers' logs; the followers stop (and their tails are
    printed) when the block ends."""
    followed: list[Logs] = []

    def start_job(doc: Obj) -> Logs:
        c.apply(ns, doc)
        logs = Logs(c, ns, doc["metadata"]["name"])
        followed.append(logs)
        return logs

    try:
        yield start_job
    finally:
        for logs in followed:
            logs.close()
            text = logs.tail() if tail is None else logs.tail(tail)
            print(f"--- {logs.job} log tail ---\n{text}")
