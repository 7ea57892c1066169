"""`make demo`: an elastic job trained through injected faults on a local cluster.

Starts a devcluster (real kube-apiserver, controller-manager and etcd; two node agents
running pods as local processes), installs the operator with helm, submits the small
example as an ElasticJob, then kills a worker process, deletes a worker pod and scales
the job up while it trains, showing live progress; it ends with a summary, a picture
of the job's timeline (``--timeline``, a PNG: elasticjob_operator/timeline.py) and one
of the chart's Grafana dashboard as a real Prometheus, scraping the operator all along,
answered its queries over the run (``--dashboard``, a PNG:
elasticjob_devcluster/dashboard_picture.py), and leaves nothing running (Prometheus and
the cluster are stopped even on Ctrl-C or an error).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config

from elasticjob_devcluster import dashboard_picture, faults, prometheus
from elasticjob_devcluster.controlplane import DevCluster
from elasticjob_operator import timeline
from elasticjob_operator.builders import selector_string

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "elasticjob-operator"
DASHBOARD = CHART / "dashboards" / "goodput.json"
MANIFEST = REPO / "examples" / "manifests" / "elastic.yaml"
NAMESPACE = "demo"
OPERATOR_NAMESPACE = "elasticjob-system"
RELEASE = "elasticjob-operator"  # its chart's fullname too (the release holds the chart's name)
METRICS_SERVICE = f"{RELEASE}-metrics"
JOB = "demo"
GROUP, VERSION, PLURAL = "elastic.pytorch.org", "v1alpha1", "elasticjobs"
Obj = dict[str, Any]


@dataclass
class Fault:
    """One injected fault and what it cost."""

    name: str
    inject: Callable[[], object]
    at_step: int = 0
    injected_at: float = 0.0  # unix time, the clock of the workers' `t=` log field
    world: int = 2  # the world size training has once the fault is fully dealt with
    recoveries: list[Recovery] | None = None  # every pause until then (a lost pod: two)


@dataclass(frozen=True)
class Recovery:
    """What a fault cost, read from the workers' logs."""

    paused_for: float  # seconds between the last step before the new round and its first
    resumed_from: int  # the step the new round started from (its checkpoint)
    world: int  # world size of the new round


@dataclass(frozen=True)
class StepLine:
    """One training log line of the example: ``step=N ... loss=L world=W ... t=T``."""

    step: int
    loss: float
    world: int
    time: float


def parse_step_line(line: str) -> StepLine | None:
    fields = dict(token.split("=", 1) for token in line.split() if "=" in token)
    try:
        return StepLine(
            int(fields["step"]), float(fields["loss"]), int(fields["world"]), float(fields["t"])
        )
    except (KeyError, ValueError):
        return None


def parse_start(line: str) -> tuple[float, int] | None:
    """When a worker (re)started training and from which step: the example's
    ``resumed from step N ...`` / ``regrouped at step N ...`` (a survivor that stayed
    alive) / ``starting fresh ...`` line carries ``t=<unix time>``."""
    words = line.split()
    if line.startswith(("resumed from step", "regrouped at step")):
        step = int(words[3])
    elif line.startswith("starting fresh"):
        step = 0
    else:
        return None
    for token in words:
        if token.startswith("t="):
            try:
                return float(token[2:]), step
            except ValueError:
                return None
    return None


def recovery(lines: list[str], injected_at: float, at_step: int) -> Recovery | None:
    """The cost of a fault injected at unix time ``injected_at`` when the workers had logged
    ``at_step``: the pause from the old round's last step (or the fault, if later) to the
    new round's first step beyond ``at_step``. None until the new round got there."""
    starts = sorted(s for s in map(parse_start, lines) if s is not None and s[0] > injected_at)
    if not starts:
        return None
    restarted, resumed_from = starts[0]
    steps = sorted(filter(None, map(parse_step_line, lines)), key=lambda p: p.time)
    first = next((p for p in steps if p.time > restarted and p.step > at_step), None)
    if first is None:
        return None
    before = [p.time for p in steps if p.time < restarted]
    paused_from = max([injected_at, *before[-1:]])
    return Recovery(first.time - paused_from, resumed_from, first.world)


def recoveries(
    lines: list[str], injected_at: float, at_step: int, world: int
) -> list[Recovery] | None:
    """Every pause a fault caused until training runs at ``world`` again: a deleted pod
    pauses the survivors when they go on without it, and again when its replacement
    joins. None until then."""
    found: list[Recovery] = []
    since, step = injected_at, at_step
    while (r := recovery(lines, since, step)) is not None:
        found.append(r)
        if r.world == world:
            return found
        starts = sorted(s[0] for s in map(parse_start, lines) if s is not None and s[0] > since)
        since, step = starts[0], -1  # the next restart after this one, any step
    return None


def parse_result(line: str) -> Obj | None:
    """The example's final ``ELASTICJOB_RESULT {json}`` line."""
    _, sep, payload = line.partition("ELASTICJOB_RESULT ")
    if not sep:
        return None
    try:
        result: Obj = json.loads(payload)
    except ValueError:
        return None
    return result


@dataclass
class Demo:
    cluster: DevCluster
    kubeconfig: Path
    started: float = field(default_factory=time.monotonic)
    shown_events: set[str] = field(default_factory=set)
    custom: client.CustomObjectsApi = field(init=False)
    core: client.CoreV1Api = field(init=False)

    def __post_init__(self) -> None:
        api = config.new_client_from_config(config_file=str(self.kubeconfig))  # type: ignore[no-untyped-call]
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)

    # -- user actions, through the tools a user has --------------------------------------
    def run(self, *args: str, input: str | None = None) -> str:
        tool = args[0]
        out = subprocess.run(
            [tool, f"--kubeconfig={self.kubeconfig}", *args[1:]],
            input=input,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed: {out.stderr.strip()}")
        return out.stdout

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)

    # -- observation ---------------------------------------------------------------------
    def job(self) -> Obj:
        obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, JOB)
        assert isinstance(obj, dict)
        return obj

    def progress(self) -> Obj:
        status: Obj = self.job().get("status") or {}
        progress: Obj = status.get("progress") or {}
        return progress

    def step(self) -> int:
        return int(self.progress().get("step") or 0)

    def worker_logs(self) -> list[str]:
        """Every current worker pod's log lines (kubectl logs, through the API server)."""
        lines: list[str] = []
        pods = self.core.list_namespaced_pod(NAMESPACE, label_selector=selector_string(JOB))
        for pod in pods.items:
            name = pod.metadata.name if pod.metadata else None
            if not name:
                continue
            try:
                text = self.core.read_namespaced_pod_log(name, NAMESPACE)
            except client.ApiException:
                continue
            lines += text.splitlines()
        return lines

    def last_logged_step(self) -> int:
        return max((p.step for p in map(parse_step_line, self.worker_logs()) if p), default=0)

    def result(self) -> Obj | None:
        for line in self.worker_logs():
            result = parse_result(line)
            if result is not None:
                return result
        return None

    def succeeded(self) -> bool:
        conditions = (self.job().get("status") or {}).get("conditions", [])
        return any(c.get("type") == "Succeeded" and c.get("status") == "True" for c in conditions)

    def recoveries(self, fault: Fault) -> list[Recovery] | None:
        return recoveries(self.worker_logs(), fault.injected_at, fault.at_step, fault.world)

    def events(self, limit: int = 3) -> list[str]:
        items = self.core.list_namespaced_event(NAMESPACE).items
        items.sort(key=event_time)
        return [f"{e.reason}: {e.message}" for e in items[-limit:]]

    def show(self) -> None:
        job = self.job()
        status: Obj = job.get("status") or {}
        progress: Obj = status.get("progress") or {}
        active = (status.get("replicaStatuses") or {}).get("Worker", {}).get("active")
        line = (
            f"phase={status.get('phase', '?'):<10} step={progress.get('step', '-'):>5} "
            f"world={progress.get('worldSize', '-')} pods={active} "
            f"restarts={status.get('restartCount', 0)} "
            f"samples/s={float(progress.get('samplesPerSecond') or 0):.0f}"
        )
        self.say(line)
        for event in self.events():
            if event not in self.shown_events:
                self.shown_events.add(event)
                print(f"          event  {event}", flush=True)

    def watch_until(self, what: str, done: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.show()
            if done():
                return
            time.sleep(2)
        raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


def event_time(event: Any) -> datetime:
    stamp = event.last_timestamp or event.event_time or event.metadata.creation_timestamp
    return stamp if isinstance(stamp, datetime) else datetime.min.replace(tzinfo=UTC)


def demo_manifest(steps: int) -> str:
    """The elastic example manifest, named for the demo and sized to train a few minutes."""
    doc: Obj = yaml.safe_load(MANIFEST.read_text())
    doc["metadata"] = {"name": JOB, "namespace": NAMESPACE}
    worker = doc["spec"]["replicaSpecs"]["Worker"]
    worker["replicas"] = 2
    container = worker["template"]["spec"]["containers"][0]
    # steps decide the end; every step logged, so a pause is measured to the step
    settings = {"TRAIN_STEPS": str(steps), "TRAIN_EPOCHS": "1000", "TRAIN_LOG_EVERY": "1"}
    env = [e for e in container.get("env", []) if e["name"] not in settings]
    container["env"] = [*env, *({"name": k, "value": v} for k, v in settings.items())]
    return yaml.safe_dump(doc)


def install_operator(demo: Demo) -> None:
    demo.say("installing the operator with helm")
    demo.run(
        "helm",
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        OPERATOR_NAMESPACE,
        "--create-namespace",
        "--wait",
        "--timeout=3m",
        # mirror progress into status every 2 s, so the live view keeps up
        "--set=resyncSeconds=2",
        # the Service the demo's Prometheus scrapes, as a ServiceMonitor would select it
        "--set=metrics.service.enabled=true",
    )


@dataclass
class Scrape:
    """The demo's Prometheus, scraping the operator's metrics since ``since`` (unix
    time); ``error``: why there is none."""

    prom: prometheus.Prometheus | None = None
    since: float = 0.0
    error: str = ""


def start_scraping(
    demo: Demo, binary: str, stack: contextlib.ExitStack, workdir: Path
) -> prometheus.Prometheus:
    """Prometheus scraping the operator's metrics Service every second, as the chart's
    ServiceMonitor has it scraped, through a relay into the devcluster's network; it and
    the relay stop (Prometheus by its pid) when ``stack`` closes."""
    endpoint = prometheus.service_monitor_endpoint(CHART)
    spec = demo.core.read_namespaced_service(METRICS_SERVICE, OPERATOR_NAMESPACE).spec
    if spec is None or not spec.cluster_ip:
        raise prometheus.PrometheusError(f"service {METRICS_SERVICE} has no clusterIP")
    (port,) = [p.port for p in spec.ports or () if p.name == endpoint["port"]]
    local = stack.enter_context(prometheus.devcluster_relay(demo.cluster, spec.cluster_ip, port))
    return stack.enter_context(
        prometheus.scraping_service(
            f"127.0.0.1:{local}",
            workdir,
            namespace=OPERATOR_NAMESPACE,
            service=METRICS_SERVICE,
            honor_labels=bool(endpoint.get("honorLabels", False)),
            binary=binary,
        )
    )


def run_demo(demo: Demo, steps: int) -> list[Fault]:
    demo.run("kubectl", "create", "namespace", NAMESPACE)
    demo.say(f"kubectl apply: ElasticJob {NAMESPACE}/{JOB} (min 1, max 4, 2 workers)")
    demo.run("kubectl", "apply", "-f", "-", input=demo_manifest(steps))
    demo.watch_until("training to start", lambda: demo.step() > 0, timeout=300)

    cluster_dir = demo.cluster.dir
    faults_to_inject = [
        Fault(
            "SIGKILL a worker process",
            lambda: faults.kill_worker_process(cluster_dir, NAMESPACE, f"{JOB}-worker-1"),
        ),
        Fault(
            "delete a worker pod",
            lambda: demo.run("kubectl", "-n", NAMESPACE, "delete", "pod", f"{JOB}-worker-0"),
        ),
        Fault(
            "kubectl scale 2 -> 3",
            lambda: demo.run(
                "kubectl", "-n", NAMESPACE, "scale", f"elasticjob/{JOB}", "--replicas=3"
            ),
            world=3,
        ),
    ]
    for fault in faults_to_inject:
        target = demo.step() + 40
        demo.watch_until(
            f"step {target}",
            lambda t=target: demo.step() >= t or demo.succeeded(),  # type: ignore[misc]
            timeout=300,
        )
        if demo.succeeded():
            demo.say(f"training finished before '{fault.name}'; raise --steps to see it")
            break
        fault.at_step = demo.last_logged_step()
        demo.say(f"FAULT: {fault.name} (last logged step {fault.at_step})")
        fault.injected_at = time.time()
        fault.inject()
        demo.watch_until(
            f"training at world size {fault.world} again",
            lambda f=fault: demo.recoveries(f) is not None or demo.succeeded(),  # type: ignore[misc]
            timeout=300,
        )
        fault.recoveries = demo.recoveries(fault)
        if fault.recoveries is not None:
            demo.say(f"'{fault.name}': {describe(fault.recoveries)}")
    demo.watch_until("the job to succeed", demo.succeeded, timeout=900)
    return faults_to_inject


def describe(pauses: list[Recovery]) -> str:
    """``training paused 0.8s, resumed from step 50 at world size 1; then 0.6s -> 2``."""
    first, *rest = pauses
    text = (
        f"training paused {first.paused_for:4.1f}s, resumed from step {first.resumed_from} "
        f"at world size {first.world}"
    )
    return text + "".join(f"; then {r.paused_for:.1f}s -> world size {r.world}" for r in rest)


def summary(demo: Demo, injected: list[Fault]) -> str:
    status: Obj = demo.job().get("status") or {}
    result = demo.result() or {}
    lines = [
        "",
        "== elasticjob demo summary ==",
        f"job {NAMESPACE}/{JOB}:  {status.get('phase')}",
        f"steps trained:    {result.get('steps', '?')} "
        f"(final world size {result.get('world_size', '?')})",
        f"worker pods replaced: {status.get('restartCount', 0)}",
    ]
    for fault in injected:
        if fault.injected_at == 0.0:
            continue
        r = fault.recoveries
        cost = "did not recover before the end" if r is None else describe(r)
        lines.append(f"  {fault.name:<26} at step {fault.at_step:>4}: {cost}")
    lines.append(
        f"loss:             {result.get('initial_loss', float('nan')):.4f} -> "
        f"{result.get('final_loss', float('nan')):.4f}"
    )
    lines.append(f"wall time:        {time.monotonic() - demo.started:.0f}s")
    goodput = status.get("goodput")
    if goodput:
        lines.append(goodput_line(goodput))
    return "\n".join(lines)


def goodput_line(goodput: Obj) -> str:
    """The job's goodput and where the rest went, as its status has it (docs/goodput.md)."""
    paused = ", ".join(f"{c} {s:.1f}s" for c, s in sorted(goodput["pausedSeconds"].items()))
    return (
        f"goodput:          {goodput['percent']} of {goodput['wallSeconds']:.0f}s "
        f"(waiting {goodput['waitingSeconds']:.1f}s, startup {goodput['startupSeconds']:.1f}s, "
        f"paused {paused or 'never'}, lost {goodput['lostSeconds']:.1f}s, "
        f"checkpoint {goodput['checkpointSeconds']:.1f}s)"
    )


def draw_timeline(demo: Demo, path: Path, timeout: float = 30) -> Path:
    """The job's timeline (``kubectl elasticjob-timeline``'s picture) at ``path``: the
    status's goodput once the operator has written it (it has by the end, unless the
    job was too short for a resync)."""
    deadline = time.monotonic() + timeout
    while True:
        job = demo.job()
        try:
            goodput = timeline.job_goodput(job)
        except timeline.TimelineError:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)
            continue
        picture = timeline.series(goodput, f"{NAMESPACE}/{JOB}")
        return timeline.draw(picture, path).resolve()


def draw_dashboard(demo: Demo, scrape: Scrape, path: Path) -> Path:
    """The chart's dashboard at ``path``: each panel's query for the demo's job, as the
    demo's Prometheus answers it from its first scrape to now, a point a second (more
    after 10000 s); x: seconds since the demo started, as its ``[  N s]`` lines count."""
    if scrape.prom is None:
        raise dashboard_picture.DashboardPictureError(scrape.error or "no Prometheus ran")
    dashboard = json.loads(DASHBOARD.read_text())
    end = time.time()
    step = float(max(1, math.ceil((end - scrape.since) / 10000)))
    answers = prometheus.query_dashboard_range(
        scrape.prom,
        dashboard,
        {"namespace": NAMESPACE, "job": JOB},
        scrape.since,
        end,
        step,
        rate_interval=f"{max(4.0, step + 1.0):.0f}s",  # Grafana's $__rate_interval
    )
    origin = end - (time.monotonic() - demo.started)
    picture = dashboard_picture.picture(
        dashboard,
        answers,
        job=f"{NAMESPACE}/{JOB}",
        origin=origin,
        origin_name="the demo's start",
        source=str(DASHBOARD.relative_to(CHART)),
    )
    return dashboard_picture.draw(picture, path).resolve()


def why(exc: Exception) -> str:
    """An error as the demo says it: ours by their message, others with their type."""
    ours = (prometheus.PrometheusError, dashboard_picture.DashboardPictureError)
    return str(exc) if isinstance(exc, ours) else f"{type(exc).__name__}: {exc}"


def stop_scraping(stack: contextlib.ExitStack) -> None:
    """Prometheus stopped by its pid, the relay closed, their files removed; what failed
    is said, not raised (the cluster is stopped next, whatever happens here)."""
    try:
        stack.close()
    except Exception as exc:
        print(f"demo: stopping Prometheus: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", type=Path, default=REPO / ".devcluster-demo")
    parser.add_argument("--steps", type=int, default=700, help="training steps of the job")
    parser.add_argument(
        "--timeline",
        type=Path,
        default=Path("demo-timeline.png"),
        help="the PNG of the job's timeline to write at the end (default: %(default)s)",
    )
    parser.add_argument(
        "--dashboard",
        type=Path,
        default=Path("demo-dashboard.png"),
        help="the PNG of the chart's Grafana dashboard, as a real Prometheus answered its "
        "queries over the run, to write at the end (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        binary = prometheus.find_binary()
    except prometheus.PrometheusMissing as exc:
        print(f"demo: the dashboard needs Prometheus: {exc}", file=sys.stderr)
        return 1
    cluster = DevCluster(args.dir)
    scraping = contextlib.ExitStack()
    print("starting the devcluster (kube-apiserver, controller-manager, etcd, 2 nodes)")
    try:
        cluster.up(("node-1", "node-2"))
        demo = Demo(cluster, cluster.kubeconfig)
        install_operator(demo)
        scrape = Scrape()
        try:
            workdir = Path(scraping.enter_context(tempfile.TemporaryDirectory(prefix="demo-prom-")))
            scrape.prom = start_scraping(demo, binary, scraping, workdir)
            scrape.since = time.time()
            demo.say(f"Prometheus scraping {OPERATOR_NAMESPACE}/{METRICS_SERVICE} every second")
        except Exception as exc:  # the dashboard's loss, not the demo's
            scrape.error = f"Prometheus did not start: {why(exc)}"
            print(f"dashboard:        {scrape.error}", file=sys.stderr)
        injected = run_demo(demo, args.steps)
        print(summary(demo, injected))
        print(demo.run("kubectl", "-n", NAMESPACE, "get", "elasticjob", JOB, "-o", "wide"))
        drawn = True
        try:
            print(f"timeline:         {draw_timeline(demo, args.timeline)}")
        except timeline.TimelineError as exc:
            print(f"timeline:         not drawn: {exc}", file=sys.stderr)
            drawn = False
        try:
            print(f"dashboard:        {draw_dashboard(demo, scrape, args.dashboard)}")
        except Exception as exc:  # said, and the exit status says it; the rest stands
            print(f"dashboard:        not drawn: {why(exc)}", file=sys.stderr)
            drawn = False
        return 0 if drawn else 1
    except KeyboardInterrupt:
        print("\ninterrupted; stopping everything", file=sys.stderr)
        return 130
    finally:
        stop_scraping(scraping)  # before the cluster: its relay dials into the cluster
        cluster.down()
        left = cluster.leftover_processes()
        if left:
            print(f"demo: processes left after stopping: {json.dumps([r.name for r in left])}")
        else:
            print("devcluster stopped; nothing left running")


if __name__ == "__main__":
    sys.exit(main())
