"""`make soak`: many small ElasticJobs trained through random faults on a devcluster.

Starts a devcluster (3 nodes), installs the operator with helm, then keeps a few jobs
training at a time (the shipped example, min 1 / max 3 workers, a few hundred steps)
until every job has run, while it injects a random fault every few seconds: a killed
training process, a deleted worker pod, `kubectl scale`, a lost node (replaced by a new
one). Faults stop after ``--minutes``; the jobs then get a bounded time to finish. At
the end every job must have Succeeded, trained every step, and its workers' sample
records (``elasticjob_examples.sample_audit``) must show no sample lost or repeated
within an epoch. The seed is printed first: ``--seed`` repeats a run's choices (the
timing of a busy machine is not repeatable). Prints a table, exits 1 on any violation,
and stops everything it started (``DevCluster.down``, by recorded process ids).

``run_soak`` works on any cluster where an operator already watches the namespace; the
e2e suite runs a two-job smoke of it (tests/e2e/test_soak_smoke.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config

from bench.pod_logs import PodLogs
from elasticjob_devcluster import faults
from elasticjob_devcluster.controlplane import DevCluster
from examples import sample_audit  # elasticjob_examples, by the path mypy sees

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "elasticjob-operator"
MANIFEST = REPO / "examples" / "manifests" / "elastic.yaml"
GROUP, VERSION, PLURAL = "elastic.pytorch.org", "v1alpha1", "elasticjobs"
JOB_LABEL = "elastic.pytorch.org/job-name"
WORKER_SELECTOR = "elastic.pytorch.org/replica-type=worker"
OPERATOR_NAMESPACE = "soak-operator"
Obj = dict[str, Any]


class FaultKind(StrEnum):
    KILL_WORKER = "kill-worker"  # SIGKILL one training process in a pod
    DELETE_POD = "delete-pod"  # kubectl delete pod
    SCALE = "scale"  # kubectl scale to another size in [1, max]
    LOSE_NODE = "lose-node"  # the node and its pods die; a new node joins


@dataclass(frozen=True)
class SoakConfig:
    seed: int
    jobs: int = 20
    minutes: float = 10.0  # faults are injected this long
    drain_minutes: float = 5.0  # then the jobs still running get this long to finish
    concurrency: int = 4  # jobs training at once
    steps: int = 300
    samples: int = 512
    batch_size: int = 8
    max_workers: int = 3
    fault_gap: tuple[float, float] = (8.0, 20.0)  # seconds between faults, uniform
    max_faults: int = 50
    node_losses: int = 2
    kinds: tuple[FaultKind, ...] = tuple(FaultKind)
    image: str | None = None  # the workers' image; None: the example manifest's


@dataclass(frozen=True)
class Target:
    """A job the fault loop may hit: its running worker pods and their nodes."""

    job: str
    replicas: int
    pods: dict[str, str]  # running worker pod -> its node


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    job: str
    pod: str = ""  # kill-worker, delete-pod
    replicas: int = 0  # scale
    node: str = ""  # lose-node


def choose_fault(
    rng: random.Random, targets: Sequence[Target], cfg: SoakConfig, spared: set[str], losses: int
) -> Fault | None:
    """The next fault, drawn with ``rng`` from what can be broken now: a job that trains
    (has running workers), a node that runs one of its workers and is not ``spared`` (the
    operator's), at most ``cfg.node_losses`` lost nodes. None when nothing can be hit."""
    if not targets:
        return None
    target = rng.choice(sorted(targets, key=lambda t: t.job))
    kinds = [k for k in cfg.kinds if k != FaultKind.LOSE_NODE or losses < cfg.node_losses]
    nodes = sorted({n for n in target.pods.values() if n not in spared})
    if not nodes:
        kinds = [k for k in kinds if k != FaultKind.LOSE_NODE]
    sizes = [n for n in range(1, cfg.max_workers + 1) if n != target.replicas]
    if not sizes:
        kinds = [k for k in kinds if k != FaultKind.SCALE]
    if not kinds or not target.pods:
        return None
    kind = rng.choice(kinds)
    if kind == FaultKind.SCALE:
        return Fault(kind, target.job, replicas=rng.choice(sizes))
    if kind == FaultKind.LOSE_NODE:
        return Fault(kind, target.job, node=rng.choice(nodes))
    return Fault(kind, target.job, pod=rng.choice(sorted(target.pods)))


@dataclass
class JobRecord:
    """One job's life in the soak, and what its logs showed at the end."""

    name: str
    started: float
    logs: PodLogs | None  # None: never started
    faults: list[str] = field(default_factory=list)
    finished: float = 0.0
    phase: str = "?"
    steps: int = 0  # ELASTICJOB_RESULT's steps
    restarts: int = 0  # status.restartCount: pods replaced
    worlds: list[int] = field(default_factory=list)  # world sizes, one per change
    epochs: int = 0
    problems: list[str] = field(default_factory=list)


def job_manifest(name: str, cfg: SoakConfig) -> Obj:
    """The shipped example, small: min 1, max ``cfg.max_workers``, 2 workers, every rank
    logging its sample indices."""
    doc: Obj = yaml.safe_load(MANIFEST.read_text())
    doc["metadata"] = {"name": name}
    doc["spec"]["maxReplicas"] = cfg.max_workers
    worker = doc["spec"]["replicaSpecs"]["Worker"]
    worker["replicas"] = 2
    container = worker["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    env.update(
        TRAIN_STEPS=str(cfg.steps),
        TRAIN_EPOCHS="1000",  # the steps decide the end
        TRAIN_SAMPLES=str(cfg.samples),
        TRAIN_BATCH_SIZE=str(cfg.batch_size),
        TRAIN_SLEEP="0.1",
        TRAIN_LOG_EVERY="10",
        TRAIN_CHECKPOINT_INTERVAL="10",
        TRAIN_LOG_SAMPLES="1",
    )
    container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    container["resources"] = {"requests": {"cpu": "50m", "memory": "128Mi"}}
    if cfg.image:
        container["image"] = cfg.image
    return doc


def result_of(lines: Sequence[str]) -> Obj:
    """Rank 0's ``ELASTICJOB_RESULT {json}`` (the last one), or {}."""
    for line in reversed(lines):
        _, sep, payload = line.partition("ELASTICJOB_RESULT ")
        if sep:
            try:
                found: Obj = json.loads(payload)
                return found
            except ValueError:
                continue
    return {}


def changes(worlds: Sequence[int]) -> list[int]:
    """``[2, 2, 3, 3, 1]`` -> ``[2, 3, 1]``: the world sizes a job went through."""
    return [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]


class Soak:
    """The I/O around the decisions: kubectl and the API as a user has them, the faults
    through the devcluster's agents."""

    def __init__(
        self,
        kubeconfig: Path,
        namespace: str,
        cfg: SoakConfig,
        dev: DevCluster | None,
        log_dir: Path | None = None,
    ) -> None:
        self.kubeconfig, self.ns, self.cfg, self.dev = kubeconfig, namespace, cfg, dev
        self.log_dir = log_dir  # each job's worker lines go to <log_dir>/<job>.log
        api = config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.rng = random.Random(cfg.seed)
        self.t0 = time.monotonic()
        self.records: dict[str, JobRecord] = {}
        self.faults = 0
        self.losses = 0
        self.spared: set[str] = set()  # nodes never lost: the operator's

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", flush=True)

    def kubectl(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["kubectl", f"--kubeconfig={self.kubeconfig}", "-n", self.ns, *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def job(self, name: str) -> Obj:
        got = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)
        assert isinstance(got, dict)
        return got

    # -- the loop ------------------------------------------------------------------------
    def run(self, operator_nodes: set[str]) -> list[JobRecord]:
        cfg = self.cfg
        self.spared = set(operator_nodes)
        pending = [f"soak-{i:02d}" for i in range(cfg.jobs)]
        active: list[str] = []
        faults_until = self.t0 + cfg.minutes * 60
        ends = faults_until + cfg.drain_minutes * 60
        next_fault = self.t0 + self.rng.uniform(*cfg.fault_gap)
        try:
            while (pending or active) and time.monotonic() < ends:
                for name in list(active):
                    if self.finish_if_done(name):
                        active.remove(name)
                while pending and len(active) < cfg.concurrency:
                    name = pending.pop(0)
                    self.start(name)
                    active.append(name)
                now = time.monotonic()
                due = next_fault <= now < faults_until and self.faults < cfg.max_faults
                if due and self.inject(active):  # else: again next round, once a job trains
                    next_fault = now + self.rng.uniform(*cfg.fault_gap)
                time.sleep(1.0)
        finally:
            for name in active:
                record = self.records[name]
                record.problems.append("did not finish within the soak's time")
                if record.logs is not None:
                    record.logs.close()
        for name in pending:
            self.records[name] = JobRecord(name, 0.0, None)
            self.records[name].problems.append("never started: the soak ran out of time")
        return [self.records[n] for n in sorted(self.records)]

    def start(self, name: str) -> None:
        out = self.kubectl("apply", "-f", "-", input=json.dumps(job_manifest(name, self.cfg)))
        selector = f"{JOB_LABEL}={name},{WORKER_SELECTOR}"
        logs = PodLogs(self.kubeconfig, self.core, self.ns, selector)
        record = JobRecord(name, time.monotonic(), logs)
        self.records[name] = record
        if out.returncode != 0:
            record.problems.append(f"kubectl apply failed: {out.stderr.strip()}")
        self.say(f"started {name}")

    def finish_if_done(self, name: str) -> bool:
        """Record a job that ended (Succeeded or Failed) and delete it, freeing its cores."""
        record = self.records[name]
        assert record.logs is not None
        try:
            status: Obj = self.job(name).get("status") or {}
        except client.ApiException:
            return False
        phase = str(status.get("phase", "?"))
        if phase not in ("Succeeded", "Failed") and not record.problems:
            return False
        time.sleep(3)  # the followers read the last lines
        record.logs.close()
        record.finished = time.monotonic()
        record.phase, record.restarts = phase, int(status.get("restartCount", 0))
        lines = record.logs.text()
        if self.log_dir is not None:  # the pods are gone after this: keep what they said
            self.log_dir.mkdir(parents=True, exist_ok=True)
            (self.log_dir / f"{name}.log").write_text(record.logs.tail(len(lines)) + "\n")
        record.steps = int(result_of(lines).get("steps", 0))
        found = sample_audit.audit(sample_audit.parse_all(lines), self.cfg.samples, self.cfg.steps)
        record.problems += found.problems
        record.epochs = found.epochs
        record.worlds = changes(found.worlds)
        if phase != "Succeeded":
            record.problems.append(f"phase {phase}")
        if record.steps != self.cfg.steps:
            record.problems.append(f"trained {record.steps} of {self.cfg.steps} steps")
        self.kubectl("delete", "elasticjob", name, "--wait=false")
        verdict = "ok" if not record.problems else "; ".join(record.problems)
        self.say(f"{name} {phase} after {record.finished - record.started:.0f}s: {verdict}")
        return True

    def targets(self, active: Sequence[str]) -> list[Target]:
        found = []
        for name in active:
            try:
                replicas = int(self.job(name)["spec"]["replicaSpecs"]["Worker"]["replicas"])
                pods: list[Any] = self.core.list_namespaced_pod(
                    self.ns, label_selector=f"{JOB_LABEL}={name},{WORKER_SELECTOR}"
                ).items
            except client.ApiException:
                continue
            running = {
                str(p.metadata.name): str(p.spec.node_name)
                for p in pods
                if p.status.phase == "Running" and p.metadata.deletion_timestamp is None
            }
            logs = self.records[name].logs
            trains = logs is not None and any(line.startswith("step=") for line in logs.text())
            if running and trains:  # only a job that trains: its rank 0 has logged a step
                found.append(Target(name, replicas, running))
        return found

    def inject(self, active: Sequence[str]) -> bool:
        """Break something, if anything trains; False when nothing could be hit."""
        fault = choose_fault(self.rng, self.targets(active), self.cfg, self.spared, self.losses)
        if fault is None:
            return False
        self.faults += 1
        what = describe(fault)
        try:
            self.apply(fault)
        except (faults.FaultError, OSError, RuntimeError) as e:
            what += f" (not done: {e})"
        self.records[fault.job].faults.append(what)
        self.say(f"fault {self.faults}: {what}")
        return True

    def apply(self, fault: Fault) -> None:
        if fault.kind == FaultKind.SCALE:
            self.checked("scale", f"elasticjob/{fault.job}", f"--replicas={fault.replicas}")
        elif fault.kind == FaultKind.DELETE_POD:
            self.checked("delete", "pod", fault.pod, "--wait=false")
        elif self.dev is None:
            raise RuntimeError("this fault needs the devcluster")
        elif fault.kind == FaultKind.KILL_WORKER:
            faults.kill_worker_process(self.dev.dir, self.ns, fault.pod)
        else:
            self.losses += 1
            self.spared.add(fault.node)  # lost for good: its pods may still show Running
            faults.lose_node(self.dev.dir, fault.node)
            new = f"soak-node-{self.losses}"
            self.dev.add_node(new)
            self.say(f"node {new} joined in place of {fault.node}")

    def checked(self, *args: str) -> None:
        out = self.kubectl(*args)
        if out.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {out.stderr.strip()}")


def describe(fault: Fault) -> str:
    if fault.kind == FaultKind.SCALE:
        return f"scale {fault.job} to {fault.replicas}"
    if fault.kind == FaultKind.LOSE_NODE:
        return f"lose {fault.node} (hit {fault.job})"
    return f"{fault.kind.value} {fault.pod}"


def table(records: Sequence[JobRecord]) -> str:
    rows = [("job", "result", "steps", "faults", "worlds", "pods replaced", "epochs", "took")]
    for r in records:
        took = f"{r.finished - r.started:.0f}s" if r.finished else "-"
        result = "ok" if not r.problems else "VIOLATION"
        rows.append(
            (
                r.name,
                result,
                str(r.steps),
                str(len(r.faults)),
                "-".join(map(str, r.worlds)) or "-",
                str(r.restarts),
                str(r.epochs),
                took,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    for r in records:
        lines += [f"  {r.name}: {p}" for p in r.problems]
    return "\n".join(lines)


def install_operator(kubeconfig: Path, namespace: str) -> None:
    """The chart, watching ``namespace`` only, mirroring progress every 2 s."""
    kube = ["kubectl", f"--kubeconfig={kubeconfig}", "create", "namespace", namespace]
    subprocess.run(kube, check=True, capture_output=True, timeout=60)
    helm = [
        "helm",
        f"--kubeconfig={kubeconfig}",
        "install",
        "soak",
        str(CHART),
        f"--namespace={OPERATOR_NAMESPACE}",
        "--create-namespace",
        "--set=resyncSeconds=2",
        f"--set=watchNamespaces={{{namespace}}}",
        "--wait",
        "--timeout=5m",
    ]
    subprocess.run(helm, check=True, capture_output=True, timeout=400)


def operator_nodes(core: Any, namespace: str) -> set[str]:
    pods = core.list_namespaced_pod(namespace).items
    return {p.spec.node_name for p in pods if p.spec.node_name}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seed", type=int, default=None, help="repeat a run's choices")
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long faults come")
    parser.add_argument("--concurrency", type=int, default=4, help="jobs training at once")
    parser.add_argument("--steps", type=int, default=300, help="training steps per job")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument(
        "--faults",
        default=",".join(FaultKind),
        help=f"the kinds to draw from, comma-separated (default: all of {', '.join(FaultKind)})",
    )
    parser.add_argument("--dir", type=Path, default=REPO / ".devcluster-soak")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    try:
        kinds = tuple(FaultKind(k.strip()) for k in args.faults.split(",") if k.strip())
    except ValueError as e:
        parser.error(f"--faults: {e}; use some of {', '.join(FaultKind)}")
    cfg = SoakConfig(
        seed=seed,
        jobs=args.jobs,
        minutes=args.minutes,
        concurrency=args.concurrency,
        steps=args.steps,
        kinds=kinds,
    )
    print(f"soak seed {seed} (repeat with: make soak SOAK_ARGS='--seed {seed}')", flush=True)
    print(f"soak config: {cfg}", flush=True)
    cluster = DevCluster(args.dir)
    records: list[JobRecord] = []
    left: list[str] = []
    try:
        cluster.up(tuple(f"node-{i}" for i in range(1, args.nodes + 1)))
        install_operator(cluster.kubeconfig, "soak")
        soak = Soak(cluster.kubeconfig, "soak", cfg, cluster, args.dir / "soak-logs")
        records = soak.run(operator_nodes(soak.core, OPERATOR_NAMESPACE))
        print(f"\n== soak summary (seed {seed}, {soak.faults} faults) ==")
        print(table(records))
        print(f"every job's worker log lines: {args.dir / 'soak-logs'}/<job>.log")
    except KeyboardInterrupt:
        print("\ninterrupted; stopping everything", file=sys.stderr)
        return 130
    finally:
        cluster.down()
        left = [r.name for r in cluster.leftover_processes()]
        print(f"left running after down: {left}" if left else "devcluster stopped; nothing left")
    bad = [r.name for r in records if r.problems]
    if not records or bad or left:
        print(f"soak FAILED: {len(bad)} of {cfg.jobs} jobs violated (seed {seed})")
        return 1
    print(f"soak passed: {len(records)} jobs (seed {seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
