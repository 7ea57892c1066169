"""``operator-load``: the operator under many ElasticJobs applied at once, on the devcluster.

One cycle of :func:`measure` installs the operator with ``helm install`` (network
policies on) on a devcluster of N node agents, then:

* applies ``--jobs`` ElasticJobs of ``--workers`` workers at once (one ``kubectl apply``;
  the workers run ``sleep``, a light command) and times until every worker pod and every
  job's etcd pod exists; the operator's peak RSS over the whole cycle and its CPU are
  sampled from /proc;
* right after, under that load, ``kubectl scale``s one job up by one and times until its
  new pod exists;
* where every pod fits on the nodes (110 each), times until all of them are Running and
  samples the operator's CPU while nothing changes;
* deletes every job and times until every child is gone, then lists every kind the
  operator creates to check that nothing is orphaned.

With one node most pods stay Pending (the operator's work without the node agents'
load); with five every pod runs. ``--etcd shared`` installs the chart with
``sharedEtcd.enabled=true`` (one etcd for every job, each job its own etcd user) and
runs the same jobs, so the cost of an etcd pod per job shows beside it.

Pod times come from one ``kubectl get --watch`` (the moment each event arrives); every
process started is recorded and killed by its pid, and each devcluster is taken down.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.harness import REPO, wait_for
from bench.report import Figure, write
from elasticjob_devcluster.controlplane import DevCluster
from elasticjob_operator import builders

RESULTS = REPO / "bench" / "results" / "operator_load.json"
SCENARIOS = ("operator-load",)  # one apply -> scale -> running -> delete cycle
MAX_PODS_PER_NODE = 110  # the devcluster's node capacity, as kubelet's default
NAMESPACE = "bench-load"
OPERATOR_NAMESPACE = "bench-operator"
SCALED_JOB = "load-0"
# Every kind the operator creates for a job (pods are watched separately).
CHILD_KINDS = "deployments,replicasets,services,secrets,networkpolicies"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def job_manifest(name: str, workers: int) -> dict[str, Any]:
    """An ElasticJob whose workers only sleep: the operator's work, not training's."""
    spec: dict[str, Any] = {
        "minReplicas": 1,
        "maxReplicas": workers + 2,
        "replicaSpecs": {
            "Worker": {
                "replicas": workers,
                "restartPolicy": "OnFailure",
                "template": {
                    "spec": {
                        "terminationGracePeriodSeconds": 5,
                        "containers": [
                            {
                                "name": "trainer",
                                "image": "elasticjob-runtime:dev",
                                "command": ["sleep", "100000"],
                            }
                        ],
                    }
                },
            }
        },
    }
    return {
        "apiVersion": "elastic.pytorch.org/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }


@dataclass
class PodTimes:
    """When the watch first saw each pod, saw it Running, and saw it deleted."""

    seen: dict[str, float] = field(default_factory=dict)
    running: dict[str, float] = field(default_factory=dict)
    terminating: dict[str, float] = field(default_factory=dict)  # deletion asked for
    deleted: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, line: str, at: float) -> None:
        parts = line.split()
        if len(parts) < 2:
            return
        kind, name = parts[0], parts[1]
        phase = parts[2] if len(parts) > 2 else ""
        with self.lock:
            if kind == "DELETED":
                self.deleted.setdefault(name, at)
                self.terminating.setdefault(name, at)
                return
            self.seen.setdefault(name, at)
            if phase == "Running":
                self.running.setdefault(name, at)
            if len(parts) > 3:  # a deletionTimestamp: the pod is terminating
                self.terminating.setdefault(name, at)

    def count(self, names: Sequence[str], which: str) -> int:
        with self.lock:
            table: dict[str, float] = getattr(self, which)
            return sum(1 for n in names if n in table)

    def last(self, names: Sequence[str], which: str) -> float:
        with self.lock:
            table: dict[str, float] = getattr(self, which)
            return max(table[n] for n in names)


@dataclass
class Usage:
    """The operator process's RSS and CPU, sampled from /proc."""

    pid: int
    peak_rss_mib: float = 0.0
    samples: list[tuple[float, float, float]] = field(default_factory=list)  # t, rss, cpu s

    def sample(self) -> None:
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
            stat = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return
        rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
        cpu = (int(stat[11]) + int(stat[12])) / CLK_TCK
        self.peak_rss_mib = max(self.peak_rss_mib, rss / 1024)
        self.samples.append((time.monotonic(), rss / 1024, cpu))

    def cpu_between(self, start: float, end: float) -> float:
        """CPU share (1.0 = one core) over [start, end] of monotonic time."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return float("nan")
        return (inside[-1][2] - inside[0][2]) / (inside[-1][0] - inside[0][0])


class Processes:
    """Processes this run started, each killed by its recorded pid (its own group)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[Any]] = []

    def start(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> Any:
        with log.open("ab") as out:
            proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> str:
    out = subprocess.run(
        ["kubectl", f"--kubeconfig={kubeconfig}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def watch_pods(kubeconfig: Path, procs: Processes, times: PodTimes, log: Path) -> None:
    """Feed ``times`` from one pod watch of the namespace (a reader thread)."""
    template = (
        "{.type} {.object.metadata.name} {.object.status.phase}"
        ' {.object.metadata.deletionTimestamp}{"\\n"}'
    )
    proc = subprocess.Popen(
        [
            "kubectl",
            f"--kubeconfig={kubeconfig}",
            "-n",
            NAMESPACE,
            "get",
            "pods",
            "-l",
            builders.LABEL_JOB,
            "--watch",
            "--output-watch-events",
            "-o",
            f"jsonpath={template}",
        ],
        stdout=subprocess.PIPE,
        stderr=log.open("ab"),
        text=True,
        start_new_session=True,
    )
    procs.procs.append(proc)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            times.record(line, time.monotonic())

    threading.Thread(target=read, name="pod-watch", daemon=True).start()


RELEASE = "bench"
CHART = REPO / "charts" / "elasticjob-operator"


def install_operator(kubeconfig: Path, resync_seconds: float, shared_etcd: bool) -> int:
    """``helm install`` the chart as a user does (network policies on; the shared etcd if
    asked), wait for the operator (and the shared etcd, which a user's jobs find running
    long before they arrive) and return the operator's pid on this host (the devcluster
    runs pods as processes here): its process whose environment names this namespace."""
    installed = subprocess.run(
        ["helm", f"--kubeconfig={kubeconfig}", "install", RELEASE, str(CHART),
         "--namespace", OPERATOR_NAMESPACE, "--create-namespace",
         "--set", f"watchNamespaces={{{NAMESPACE}}}",
         "--set-json", f"resyncSeconds={resync_seconds}",
         "--set", f"sharedEtcd.enabled={str(shared_etcd).lower()}",
         "--set", "metrics.enabled=false", "--wait", "--timeout=300s"],
        capture_output=True, text=True, timeout=330,
    )  # fmt: skip
    if installed.returncode != 0:
        raise RuntimeError(f"helm install: {installed.stderr.strip()}")
    if shared_etcd:
        kubectl(
            kubeconfig, "-n", OPERATOR_NAMESPACE, "rollout", "status",
            f"deployment/{RELEASE}-elasticjob-operator-etcd", "--timeout=120s",
        )  # fmt: skip
    pid: int = wait_for("the operator's process", _operator_pid, 60)
    return pid


def _operator_pid() -> int | None:
    wanted = f"ELASTICJOB_NAMESPACES={NAMESPACE}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if b"elasticjob_operator.handlers" in cmdline and wanted in environ.split(b"\0"):
            return int(entry.name)
    return None


def operator_ready(kubeconfig: Path, shared_etcd: bool) -> bool | None:
    """The operator has switched the shared etcd's authentication on (nothing to wait
    for with an etcd per job)."""
    if not shared_etcd:
        return True
    deployment = f"deploy/{RELEASE}-elasticjob-operator"
    log = kubectl(kubeconfig, "-n", OPERATOR_NAMESPACE, "logs", deployment)
    return True if "authentication switched on" in log else None


def uninstall_operator(kubeconfig: Path, log: Path) -> None:
    """The release gone, and its namespace with the shared etcd's Secret helm left."""
    deployment = f"deploy/{RELEASE}-elasticjob-operator"
    with contextlib.suppress(RuntimeError):
        log.write_text(kubectl(kubeconfig, "-n", OPERATOR_NAMESPACE, "logs", deployment))
    subprocess.run(
        ["helm", f"--kubeconfig={kubeconfig}", "uninstall", RELEASE, "--namespace",
         OPERATOR_NAMESPACE, "--wait", "--timeout=120s"],
        check=False, capture_output=True, timeout=150,
    )  # fmt: skip
    with contextlib.suppress(RuntimeError):
        kubectl(kubeconfig, "delete", "namespace", OPERATOR_NAMESPACE, "--wait=false")


def children_left(kubeconfig: Path) -> list[str]:
    out = kubectl(
        kubeconfig, "-n", NAMESPACE, "get", f"pods,{CHILD_KINDS}", "-l", builders.LABEL_JOB,
        "-o", "name",
    )  # fmt: skip
    return out.split()


@dataclass
class Measured:
    create: float | None = None
    workers_created: float | None = None  # of create: the operator's own pods
    etcds_created: float | None = None  # of create: the etcd pods (kube-controller-manager's)
    load: float | None = None  # 1-minute load average when everything was created
    scale: float | None = None
    running: float | None = None
    delete: float | None = None
    pods_terminating: float | None = None  # of delete: until every pod's deletion was asked
    orphans: list[str] = field(default_factory=list)
    peak_rss_mib: float = 0.0
    idle_rss_mib: float = 0.0
    steady_cpu: float = float("nan")
    busy_cpu: float = float("nan")
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Options:
    jobs: int
    workers: int
    limit: float  # seconds per phase
    resync_seconds: float
    quick: bool = False  # create, scale and delete only: no wait for every pod Running
    profile: Path | None = None  # a py-spy profile of the operator (speedscope JSON)


def measure(cluster: DevCluster, workdir: Path, shared_etcd: bool, opts: Options) -> Measured:
    """One apply -> scale -> running -> delete cycle; see the module docstring."""
    kubeconfig = cluster.kubeconfig
    kubectl(kubeconfig, "apply", "-f", str(REPO / "crds" / "elasticjob.yaml"))
    kubectl(kubeconfig, "create", "namespace", NAMESPACE)
    result = Measured()
    procs = Processes()
    times = PodTimes()
    try:
        operator = install_operator(kubeconfig, opts.resync_seconds, shared_etcd)
        wait_for("the operator ready", lambda: operator_ready(kubeconfig, shared_etcd), 120)
        usage = Usage(operator)
        spy = None
        if opts.profile is not None:
            spy = procs.start(
                ["py-spy", "record", "--pid", str(operator), "--format", "speedscope",
                 "-o", str(opts.profile)], workdir / "py-spy.log",
            )  # fmt: skip
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                usage.sample()
                stop.wait(0.25)

        threading.Thread(target=sample, name="usage", daemon=True).start()
        watch_pods(kubeconfig, procs, times, workdir / "watch.log")
        time.sleep(5)  # the operator has listed the (empty) namespace; its idle size
        result.idle_rss_mib = round(usage.peak_rss_mib, 1)
        jobs, workers, limit = opts.jobs, opts.workers, opts.limit
        names = [f"load-{i}" for i in range(jobs)]
        workers_ = [builders.worker_pod_name(n, i) for n in names for i in range(workers)]
        manifests = {"apiVersion": "v1", "kind": "List", "items": [
            job_manifest(n, workers) for n in names
        ]}  # fmt: skip
        applied = time.monotonic()
        kubectl(kubeconfig, "apply", "-f", "-", stdin=json.dumps(manifests))

        def etcds() -> list[str]:
            with times.lock:
                return [p for p in times.seen if "-etcd-" in p and p not in times.deleted]

        expected_etcds = 0 if shared_etcd else jobs

        def all_created() -> bool | None:
            done = times.count(workers_, "seen") == len(workers_)
            return True if done and len(etcds()) >= expected_etcds else None

        wait_for(f"{len(workers_)} worker pods and {expected_etcds} etcds", all_created, limit)
        result.workers_created = round(times.last(workers_, "seen") - applied, 2)
        if etcds():
            result.etcds_created = round(times.last(etcds(), "seen") - applied, 2)
        result.create = max(result.workers_created, result.etcds_created or 0.0)
        result.load = round(os.getloadavg()[0], 1)

        scaled = time.monotonic()
        kubectl(kubeconfig, "-n", NAMESPACE, "scale", f"elasticjob/{SCALED_JOB}",
                f"--replicas={workers + 1}")  # fmt: skip
        new_pod = builders.worker_pod_name(SCALED_JOB, workers)
        wait_for(f"pod {new_pod}", lambda: times.seen.get(new_pod), limit)
        result.scale = round(times.seen[new_pod] - scaled, 2)

        every = [*workers_, new_pod]

        def all_running() -> bool | None:
            done = times.count(every, "running") == len(every)
            return True if done and times.count(etcds(), "running") >= expected_etcds else None

        if not opts.quick:
            wait_for(f"{len(every)} pods Running", all_running, limit)
            result.running = round(max(times.last(every, "running"), times.last(
                etcds(), "running") if etcds() else 0.0) - applied, 2)  # fmt: skip
        busy_end = time.monotonic()
        result.busy_cpu = round(usage.cpu_between(applied, busy_end), 3)
        if not opts.quick:
            time.sleep(3 * opts.resync_seconds)  # nothing changes: resyncs only
            result.steady_cpu = round(usage.cpu_between(busy_end + 1, time.monotonic()), 3)
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its profile and exits
            spy.wait(timeout=60)

        deleted = time.monotonic()
        kubectl(kubeconfig, "-n", NAMESPACE, "delete", "elasticjobs", "--all", "--wait=false")
        pods = list(times.seen)

        def all_gone() -> bool | None:
            if times.count(pods, "deleted") < len(pods):
                return None
            return True if not children_left(kubeconfig) else None

        wait_for("every child deleted", all_gone, limit)
        result.delete = round(time.monotonic() - deleted, 2)
        result.pods_terminating = round(times.last(pods, "terminating") - deleted, 2)
        time.sleep(2)  # anything re-created late would show now
        result.orphans = children_left(kubeconfig)
        stop.set()
        result.peak_rss_mib = round(usage.peak_rss_mib, 1)
    except (TimeoutError, RuntimeError) as exc:
        result.errors.append(str(exc))
    finally:
        procs.stop()
        uninstall_operator(kubeconfig, workdir / "operator.log")
        with contextlib.suppress(RuntimeError):
            kubectl(kubeconfig, "delete", "namespace", NAMESPACE, "--wait=false")
    return result


def figures(
    per_job: list[Measured], shared: list[Measured], jobs: int, workers: int, nodes: int
) -> list[Figure]:
    """The rows of one node count: the targets hold for per-job etcds (the default)."""
    case = f"{jobs} jobs x {workers} workers, {nodes} node{'s' if nodes > 1 else ''}"

    def vals(runs: list[Measured], attr: str) -> list[float]:
        return [getattr(r, attr) for r in runs if getattr(r, attr) is not None]

    orphans = sum(len(r.orphans) for r in per_job)
    loads = ", ".join(str(r.load) for r in per_job)
    rows = [
        Figure("operator-load", case, f"all {jobs * workers} worker pods + {jobs} etcds created",
               "s", vals(per_job, "create"), target="<= 30 s",
               note=f"load {loads}; of it the operator's worker pods "
                    f"{vals(per_job, 'workers_created')} s, the etcd pods (the Deployments' "
                    f"ReplicaSets, kube-controller-manager) {vals(per_job, 'etcds_created')} s"),
        Figure("operator-load", case, "kubectl scale -> its new pod (under that load)", "s",
               vals(per_job, "scale"), target="<= 2 s"),
        Figure("operator-load", case, "operator peak RSS", "MiB", vals(per_job, "peak_rss_mib"),
               target="<= 120 MiB"),
        Figure("operator-load", case, "operator RSS before any job", "MiB",
               vals(per_job, "idle_rss_mib")),
        Figure("operator-load", case, "operator CPU, apply -> all created or Running",
               "cores", vals(per_job, "busy_cpu")),
        Figure("operator-load", case, "jobs deleted -> every child gone", "s",
               vals(per_job, "delete"), target="<= 30 s, no orphans",
               note=f"orphans: {orphans}; every pod's deletion asked for (the operator's part) "
                    f"after {vals(per_job, 'pods_terminating')} s, the rest is the node agents "
                    "stopping them and the garbage collector's Secrets"),
    ]  # fmt: skip
    if vals(per_job, "running"):
        rows += [
            Figure("operator-load", case, "operator CPU, steady (resyncs only)", "cores",
                   vals(per_job, "steady_cpu")),
            Figure("operator-load", case, "apply -> every pod Running, an etcd per job", "s",
                   vals(per_job, "running"), vals(shared, "running"),
                   baseline_name="one shared etcd (sharedEtcd.enabled)"),
        ]  # fmt: skip
    if shared:  # the same cycle with sharedEtcd.enabled: no targets, stated beside
        rows += [
            Figure("operator-load", case, f"shared etcd: all {jobs * workers} worker pods created",
                   "s", vals(shared, "create")),
            Figure("operator-load", case, "shared etcd: kubectl scale -> its new pod", "s",
                   vals(shared, "scale")),
            Figure("operator-load", case, "shared etcd: operator peak RSS", "MiB",
                   vals(shared, "peak_rss_mib")),
            Figure("operator-load", case, "shared etcd: jobs deleted -> every child gone", "s",
                   vals(shared, "delete"),
                   note=f"orphans: {sum(len(r.orphans) for r in shared)}; every pod's deletion "
                        f"asked for after {vals(shared, 'pods_terminating')} s; each job's etcd "
                        "user removed too"),
        ]  # fmt: skip
    failures = [e for r in per_job + shared for e in r.errors]
    for row in rows:
        row.failures = failures
    create, scale, rss, _, _, delete = rows[:6]
    for row, bound in ((create, 30.0), (scale, 2.0), (rss, 120.0), (delete, 30.0)):
        if row.ours and not failures:  # every run within it; the delete without orphans
            row.met = max(row.ours) <= bound and (row is not delete or not orphans)
    return rows


@contextlib.contextmanager
def devcluster(nodes: int, workdir: Path) -> Iterator[DevCluster]:
    cluster = DevCluster(workdir / "devcluster")
    cluster.up([f"node-{i + 1}" for i in range(nodes)])
    try:
        yield cluster
    finally:
        cluster.down()
        left = cluster.leftover_processes()
        if left:
            print(f"processes survived the devcluster's down: {left}", file=sys.stderr)


def run(
    nodes: Sequence[int], modes: Sequence[str], reps: int, opts: Options, workdir: Path
) -> list[Figure]:
    """Every node count on a devcluster of its own; every pod Running is waited for only
    where they all fit (110 pods a node)."""
    found: list[Figure] = []
    for count in nodes:
        fits = count * MAX_PODS_PER_NODE >= opts.jobs * (opts.workers + 1) + 1
        here = replace(opts, quick=opts.quick or not fits)
        per_job: list[Measured] = []
        shared: list[Measured] = []
        work = workdir / f"operator-load-{count}"
        with devcluster(count, work) as cluster:
            for rep in range(reps):
                for mode in modes:
                    out = work / f"{mode}-{rep}"
                    out.mkdir(parents=True)
                    m = measure(cluster, out, mode == "shared", here)
                    print(f"operator-load {count} nodes {mode} rep {rep}: {m}", flush=True)
                    (per_job if mode == "per-job" else shared).append(m)
                    # the namespaces must be gone before the next cycle creates them again
                    wait_for("the namespaces deleted", lambda: None if {
                        f"namespace/{NAMESPACE}", f"namespace/{OPERATOR_NAMESPACE}"} & set(
                        kubectl(cluster.kubeconfig, "get", "namespaces", "-o", "name").split()
                    ) else True, opts.limit)  # fmt: skip
        found += figures(per_job, shared, opts.jobs, opts.workers, count)
    return found


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=50)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument(
        "--nodes", type=int, nargs="+", default=[1, 5], help="node agents (110 pods each)"
    )
    p.add_argument("--reps", type=int, default=1)
    p.add_argument(
        "--etcd", nargs="+", choices=["per-job", "shared"], default=["per-job", "shared"]
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per phase")
    p.add_argument("--resync", type=float, default=10.0, help="the operator's resync period")
    p.add_argument("--quick", action="store_true", help="no wait for every pod Running")
    p.add_argument("--profile", type=Path, help="write a py-spy profile of the operator here")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    opts = Options(args.jobs, args.workers, args.timeout, args.resync, args.quick, args.profile)
    with tempfile.TemporaryDirectory(prefix="operator-load-") as tmp:
        found = run(args.nodes, args.etcd, args.reps, opts, Path(tmp))
    write(found, args.out, {"jobs": args.jobs, "workers": args.workers, "nodes": args.nodes})
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
