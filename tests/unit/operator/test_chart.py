"""The Helm chart and the Dockerfile, checked without a cluster: `helm lint` is clean, the
rendered objects are what the operator needs (and no more), and both images run non-root."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "elasticjob-operator"


def helm(*args: str) -> str:
    exe = shutil.which("helm")
    assert exe, "helm is not on PATH: run `make setup` (it installs the pinned helm)"
    out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def render(*sets: str) -> list[dict[str, Any]]:
    args = ["template", "rel", str(CHART), "--namespace", "ops"]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args)) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_helm_lint_is_clean_in_both_modes() -> None:
    assert "0 chart(s) failed" in helm("lint", str(CHART))
    assert "0 chart(s) failed" in helm("lint", str(CHART), "--set", "watchNamespaces={a,b}")


@pytest.mark.parametrize("value", ["resyncSeconds=-1", "reconcileWorkers=1"])
def test_bad_values_are_refused_by_the_values_schema(value: str) -> None:
    out = subprocess.run(
        ["helm", "template", "rel", str(CHART), "--set", value],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode != 0 and value.split("=")[0] in out.stderr


def test_deployment_runs_one_standalone_kopf_with_a_liveness_probe() -> None:
    (dep,) = by_kind(render(), "Deployment")
    spec = dep["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    cmd = container["command"]
    assert cmd[:5] == ["kopf", "run", "--standalone", "-m", "elasticjob_operator.handlers"]
    assert "--all-namespaces" in cmd
    assert "--liveness=http://0.0.0.0:8080/healthz" in cmd
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["serviceAccountName"] == "rel-elasticjob-operator"


def rules(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_cluster_wide_install_uses_one_least_privilege_cluster_role() -> None:
    docs = render()
    (role,) = by_kind(docs, "ClusterRole")
    granted = rules(role)
    assert ("", "pods", "create") in granted
    assert ("elastic.pytorch.org", "elasticjobs/status", "patch") in granted
    assert ("apps", "deployments", "delete") in granted
    assert not any(r in ("configmaps", "nodes", "*") for _, r, _ in granted)
    # the jobs' etcd certificates: created (a lost client Secret is created again from the
    # CA key in the server Secret) and read back (get); never changed, listed, watched or
    # deleted (the garbage collector does)
    assert {v for _, r, v in granted if r == "secrets"} == {"get", "create"}
    assert not any(v == "*" for _, _, v in granted)
    assert ("elastic.pytorch.org", "elasticjobs", "create") not in granted
    # a status is merge-patched, never replaced (tests/e2e/test_security.py proves the rest)
    assert ("elastic.pytorch.org", "elasticjobs/status", "update") not in granted
    assert ("networking.k8s.io", "networkpolicies", "create") in granted
    (binding,) = by_kind(docs, "ClusterRoleBinding")
    assert binding["subjects"][0]["namespace"] == "ops"
    assert not by_kind(docs, "Role")


def test_restricted_namespaces_get_roles_only_there() -> None:
    docs = render("watchNamespaces={team-a,team-b}")
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in by_kind(docs, "Role")) == [
        "team-a",
        "team-b",
    ]
    assert len(by_kind(docs, "RoleBinding")) == 2
    (dep,) = by_kind(docs, "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert "--namespace=team-a" in container["command"]
    assert "--all-namespaces" not in container["command"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["ELASTICJOB_NAMESPACES"] == "team-a,team-b"


def test_chart_carries_the_generated_crd() -> None:
    assert (CHART / "crds" / "elasticjob.yaml").read_text() == (
        REPO / "crds" / "elasticjob.yaml"
    ).read_text()


def test_dockerfile_has_both_targets_non_root_with_cis_pip_lines() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM .* AS operator$", text, re.M)
    assert re.search(r"^FROM .* AS runtime$", text, re.M)
    assert text.count("USER 65532:65532") == 2
    # the same pip invocations as scripts/bootstrap.sh, with each image's extra
    bootstrap = (REPO / "scripts" / "bootstrap.sh").read_text()
    upgrade = re.compile(r'pip"? install -U pip setuptools wheel')
    assert upgrade.search(bootstrap) and upgrade.search(text)
    assert re.search(r'pip"? install -c "\$repo/constraints.txt" -e "\$repo\[dev\]"', bootstrap)
    stages = {
        m.group(2): m.group(3)
        for m in re.finditer(r"^FROM (\S+) AS (\S+)\n(.*?)(?=^FROM |\Z)", text, re.M | re.S)
    }
    for extra in ("operator", "runtime"):  # the extra's requirements, then the code alone
        deps, build, final = stages[f"{extra}-deps"], stages[f"{extra}-build"], stages[extra]
        assert f"requirements.py {extra} > /tmp/requirements.txt" in deps
        assert "pip install -c constraints.txt -r /tmp/requirements.txt" in deps
        assert "COPY operator" not in deps  # no code in the dependencies' layer
        assert "pip install --no-deps --no-build-isolation --target /opt/elasticjob ." in build
        # two layers in the image: the venv (no code, so a code change leaves it as it
        # was), then the code
        venv = re.search(r"^COPY --from=(\S+) /opt/venv /opt/venv$", final, re.M)
        assert venv and "COPY operator" not in stages[venv.group(1)]
        assert f"COPY --from={extra}-build /opt/elasticjob /opt/elasticjob" in final
        assert final.index("/opt/venv /opt/venv") < final.index("/opt/elasticjob /opt/elasticjob")
        assert "PATH=/opt/elasticjob/bin:/opt/venv/bin:" in final
    # no `# syntax=` line: BuildKit would fetch that frontend image from a registry
    assert "# syntax" not in text
    check = "assert not {'torch', 'grpc'} & set(sys.modules)"  # the build's own check
    assert check in stages["operator-build"]
    for stage in ("operator-deps", "operator-build", "operator-venv"):
        assert "torch" not in stages[stage].replace(check, "")


@pytest.mark.parametrize("values", [[], ["metrics.service.enabled=true"]])
def test_metrics_port_is_exposed_when_enabled(values: list[str]) -> None:
    docs = render(*values)
    (dep,) = by_kind(docs, "Deployment")
    ports = {
        p["name"]: p["containerPort"]
        for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]
    }
    assert ports == {"liveness": 8080, "metrics": 8000}
    assert bool(by_kind(docs, "Service")) == bool(values)


def env_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = by_kind(docs, "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_network_policies_are_on_by_default_and_the_operator_knows_its_pods() -> None:
    docs = render()
    env = env_of(docs)
    assert env["ELASTICJOB_NETWORK_POLICY"] == "true"
    assert env["ELASTICJOB_OPERATOR_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    (dep,) = by_kind(docs, "Deployment")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    pairs = dict(p.split("=", 1) for p in env["ELASTICJOB_OPERATOR_LABELS"].split(","))
    assert pairs == dep["spec"]["selector"]["matchLabels"]
    assert pairs.items() <= pod_labels.items()  # they select the operator's own pods


def test_the_value_turns_network_policies_off_and_their_rights_with_them() -> None:
    docs = render("networkPolicy.enabled=false", "watchNamespaces={a}")
    assert env_of(docs)["ELASTICJOB_NETWORK_POLICY"] == "false"
    (role,) = by_kind(docs, "Role")
    assert not any(r == "networkpolicies" for _, r, _ in rules(role))


@pytest.mark.parametrize(("value", "env"), [(None, "auto"), ("true", "true"), ("false", "false")])
def test_gang_scheduling_is_auto_by_default_and_false_takes_its_rights(
    value: str | None, env: str
) -> None:
    docs = render(*([f"gangScheduling.enabled={value}"] if value else []))
    assert env_of(docs)["ELASTICJOB_GANG_SCHEDULING"] == env
    (role,) = by_kind(docs, "ClusterRole")
    granted = ("scheduling.k8s.io", "workloads", "create") in rules(role)
    assert granted is (env != "false")


def test_a_bad_gang_scheduling_value_is_refused_by_the_schema() -> None:
    out = subprocess.run(
        ["helm", "template", "rel", str(CHART), "--set", "gangScheduling.enabled=maybe"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode != 0 and "/gangScheduling/enabled" in out.stderr


def test_the_shared_etcd_is_rendered_only_when_enabled() -> None:
    assert len(by_kind(render(), "Deployment")) == 1
    docs = render("sharedEtcd.enabled=true")
    names = {d["metadata"]["name"] for d in docs if d["kind"] in ("Deployment", "Service")}
    assert "rel-elasticjob-operator-etcd" in names
    (operator,) = [
        d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "rel-elasticjob-operator"
    ]
    env = {
        e["name"]: e.get("value")
        for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["ELASTICJOB_SHARED_ETCD_SERVICE"] == "rel-elasticjob-operator-etcd"
    assert env["ELASTICJOB_SHARED_ETCD_SECRET"] == "rel-elasticjob-operator-etcd-tls"


def test_the_shared_etcd_runs_as_a_jobs_own_etcd_does() -> None:
    from elasticjob_operator import builders, models

    docs = render("sharedEtcd.enabled=true")
    (etcd,) = [
        d
        for d in by_kind(docs, "Deployment")
        if d["metadata"]["name"] == "rel-elasticjob-operator-etcd"
    ]
    # the operator's builder for a job whose etcd would carry the same name
    ref = builders.JobRef(name="rel-elasticjob-operator", namespace="ops", uid="u")
    spec = models.ElasticJobSpec.model_validate(
        {
            "replicaSpecs": {
                "Worker": {"template": {"spec": {"containers": [{"name": "t", "image": "i"}]}}}
            }
        }
    )
    own = builders.etcd_deployment(ref, spec)
    ours, theirs = etcd["spec"]["template"]["spec"], own["spec"]["template"]["spec"]
    (c1,), (c2,) = ours["containers"], theirs["containers"]
    assert c1["args"] == c2["args"]
    assert c1["env"] == c2["env"] and c1["readinessProbe"] == c2["readinessProbe"]
    assert c1["securityContext"] == c2["securityContext"]
    assert ours["securityContext"] == theirs["securityContext"]
    assert c1["image"] == models.DEFAULT_ETCD_IMAGE
    tls = next(v for v in ours["volumes"] if v["name"] == "tls")["secret"]
    assert tls["secretName"] == "rel-elasticjob-operator-etcd-tls"
    assert [i["key"] for i in tls["items"]] == list(builders.ETCD_MOUNTED_KEYS)  # no CA key
    # the operator's Deployment must not claim the etcd's pods
    (operator,) = [d for d in by_kind(docs, "Deployment") if d is not etcd]
    selector = operator["spec"]["selector"]["matchLabels"]
    labels = etcd["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= labels.items()


def test_the_shared_etcd_admits_watched_workers_and_the_operator_only() -> None:
    docs = render("sharedEtcd.enabled=true", "watchNamespaces={a,b}")
    (policy,) = [
        d
        for d in by_kind(docs, "NetworkPolicy")
        if d["metadata"]["name"] == "rel-elasticjob-operator-etcd"
    ]
    (rule,) = policy["spec"]["ingress"]
    workers, operator = rule["from"]
    assert workers["podSelector"]["matchLabels"] == {"elastic.pytorch.org/replica-type": "worker"}
    assert workers["namespaceSelector"]["matchExpressions"][0]["values"] == ["a", "b"]
    assert operator["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "elasticjob-operator"
    assert rule["ports"] == [{"protocol": "TCP", "port": 2379}]
    # its Secret lives in the operator's namespace, which it does not watch
    (role,) = [d for d in by_kind(docs, "Role") if d["metadata"]["namespace"] == "ops"]
    verbs = {v for r in role["rules"] for v in r["verbs"]}
    assert verbs == {"get", "create"}
    assert not [
        d
        for d in by_kind(
            render("sharedEtcd.enabled=true", "networkPolicy.enabled=false"), "NetworkPolicy"
        )
    ]


def test_the_goodput_dashboard_and_service_monitor_come_only_when_asked_for() -> None:
    assert not by_kind(render(), "ConfigMap") and not by_kind(render(), "ServiceMonitor")
    docs = render(
        "metrics.service.enabled=true",
        "metrics.serviceMonitor.enabled=true",
        "metrics.dashboard.enabled=true",
    )
    (board,) = by_kind(docs, "ConfigMap")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's default
    dashboard = json.loads(board["data"]["elasticjob-goodput.json"])
    assert dashboard["uid"] == "elasticjob-goodput"
    (monitor,) = by_kind(docs, "ServiceMonitor")
    (service,) = by_kind(docs, "Service")
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert selected.items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    # the series' own namespace and job labels, not the Service's (the dashboard selects
    # on them; elasticjob_devcluster/prometheus.py scrapes with this setting)
    assert [e.get("honorLabels") for e in monitor["spec"]["endpoints"]] == [True]


def test_a_service_monitor_without_the_service_is_refused_saying_why() -> None:
    exe = shutil.which("helm")
    assert exe
    args = ["template", "rel", str(CHART), "--set", "metrics.serviceMonitor.enabled=true"]
    out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode != 0 and "metrics.service.enabled=true" in out.stderr


def test_every_query_of_the_dashboard_names_metrics_the_operator_exports() -> None:
    from datetime import UTC, datetime

    from prometheus_client import REGISTRY, generate_latest

    from elasticjob_operator import metrics, models

    at = datetime(2026, 1, 1, tzinfo=UTC)
    last = models.LastRecovery(cause="failure", pause_seconds=0.5, step=3, time=at)
    goodput = models.Goodput(
        run_id="uid",
        ratio=0.5, percent="50.0%", wall_seconds=2, training_seconds=1, waiting_seconds=0,
        startup_seconds=0.5, paused_seconds={"failure": 0.5}, lost_seconds=0,
        checkpoint_seconds=0, recoveries={"failure": 1}, longest_pause_seconds=0.5,
        through_time=at, last_recovery=last,
    )  # fmt: skip
    progress = models.Progress(step=3, samples_per_second=1.0)
    after = models.ElasticJobStatus(goodput=goodput, progress=progress)
    metrics.job_round("dash", "board", models.ElasticJobStatus(), after)
    try:
        exposition = generate_latest(REGISTRY).decode()
    finally:
        metrics.forget_job("dash", "board")
    exported = set(re.findall(r"^(elasticjob_\w+)\{[^}]*job=\"board\"", exposition, re.M))
    dashboard = json.loads((CHART / "dashboards" / "goodput.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    named = {m for e in exprs for m in re.findall(r"\belasticjob_\w+", e)}
    assert named and named <= exported, named - exported
