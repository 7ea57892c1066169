"""Hostile ElasticJobs against the real API server with the operator installed.

Hypothesis edits a good job (``elasticjob_manifests.job``) at one to three places:
wrong types, numbers past int64, min above max, names and env far past any limit, odd
unicode (bidi controls, NUL, astral planes), parts removed. Each object must be refused
by the CRD's validation with an offending field named in the error, or accepted and then
handled by the operator: a status with a phase, and when the job failed, a message naming
what is wrong. Throughout, the operator pod never restarts and stays ready, and at the
end it still runs a normal job to success.

Examples are bounded (``EXAMPLES``, derandomized, no example database) so that the test
takes a few minutes on a loaded 2-core machine; the fixed MALFORMED cases of
test_operator.py cover the named refusals one by one.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from elasticjob_manifests import job
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kube_helpers import Cluster, Obj, Operator, installed_operator, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

EXAMPLES = 50
# An endpoint outside the cluster: no etcd is provisioned per job (50 of them would not
# fit the machine), and the operator's progress reads fail fast.
ENDPOINT = "etcd-nowhere:2379"
W = "spec.replicaSpecs.Worker"
C0 = f"{W}.template.spec.containers.0"
DELETE = "<delete>"

# Where hostile values go: every spec field, the pod template's parts, the name.
PATHS = (
    "metadata.name",
    "spec.minReplicas",
    "spec.maxReplicas",
    f"{W}.replicas",
    f"{W}.restartPolicy",
    f"{W}.template",
    f"{W}.template.metadata",
    f"{W}.template.spec",
    f"{W}.template.spec.containers",
    f"{C0}.name",
    f"{C0}.image",
    f"{C0}.command",
    f"{C0}.env",
    "spec.replicaSpecs",
    "spec.rdzvEndpoint",
    "spec.rdzvBackend",
    "spec.rdzvConf",
    "spec.nprocPerNode",
    "spec.maxRestarts",
    "spec.cleanPodPolicy",
    "spec.ttlSecondsAfterFinished",
    "spec.activeDeadlineSeconds",
    "spec.backoffLimit",
    "spec.suspend",
    "spec.etcd",
    "spec.shmSize",
    "spec.hangTimeoutSeconds",
    "spec.schedulingPolicy",
    "spec.somethingElse",
)

ODD = (
    "",
    " ",
    "0",
    "-1",
    "1e400",
    "auto",
    "etcd-v3",
    "Ab",
    "a" * 300,
    "x:1",
    "\u202eevil",  # right-to-left override
    "\x00",
    "\U0001f600" * 3,  # astral plane
    "ﬁ",  # a ligature that NFKC turns into two letters
    "ӕ-worker",
    "a,b=c",
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=12),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(ODD),
    st.text(max_size=20),
)
values = st.one_of(
    scalars,
    st.just(DELETE),
    st.lists(scalars, max_size=3),
    st.dictionaries(
        st.sampled_from(["a", "name", "image", "join_timeout", "x y"]), scalars, max_size=3
    ),
    st.integers(min_value=1_000, max_value=100_000).map(lambda n: "n" * n),  # enormous strings
)


def big_env(n: int, size: int) -> list[Obj]:
    return [{"name": f"V_{i}", "value": "v" * size} for i in range(n)]


edits = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(PATHS), values),
        # enormous env: up to 400 KB, under the API server's and etcd's request limits
        st.tuples(
            st.just(f"{C0}.env"),
            st.builds(big_env, st.integers(1, 400), st.integers(0, 1000)),
        ),
        # min above max, replicas outside [min, max]
        st.tuples(st.sampled_from(["spec.minReplicas", f"{W}.replicas"]), st.integers(5, 50)),
    ),
    min_size=1,
    max_size=3,
    unique_by=lambda e: e[0],
)


def apply_edit(obj: Obj, path: str, value: Any) -> None:
    keys = path.split(".")
    node: Any = obj
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node.get(k)
        if not isinstance(node, dict | list):
            return  # an earlier edit removed or replaced the parent
    last = keys[-1]
    if isinstance(node, list):
        return
    if value == DELETE:
        node.pop(last, None)
    else:
        node[last] = value


def field_name(path: str) -> str:
    """The name an error about ``path`` must use: its own key (``spec`` alone, which every
    message has, would prove nothing)."""
    return next(k for k in reversed(path.split(".")) if not k.isdigit())


@dataclass
class Verdict:
    accepted: bool
    detail: str


def submit(c: Cluster, ns: str, obj: Obj) -> Verdict:
    out = c.kubectl("-n", ns, "create", "-f", "-", input=json.dumps(obj), check=False)
    return Verdict(out.returncode == 0, (out.stderr or out.stdout).strip())


def operator_healthy(op: Operator) -> str | None:
    """Why the operator pod is not fine (restarted, not ready, gone), or None."""
    pods = op.pods()
    if len(pods) != 1:
        return f"{len(pods)} operator pods"
    statuses = pods[0].status.container_statuses or []
    for s in statuses:
        if s.restart_count:
            return f"operator container {s.name} restarted {s.restart_count}x"
        if not s.ready:
            return f"operator container {s.name} is not ready"
    return None if statuses else "operator pod has no container status"


@pytest.fixture(scope="module")
def cluster(kubeconfig: Path) -> Cluster:
    return Cluster(kubeconfig)


@pytest.fixture(scope="module")
def installed(cluster: Cluster) -> Iterator[Operator]:
    with installed_operator(cluster, "hi") as op:
        yield op


def test_hostile_jobs_are_refused_naming_a_field_or_reported_and_the_operator_survives(
    cluster: Cluster, installed: Operator
) -> None:
    c, ns = cluster, installed.job_namespace
    problems: list[str] = []
    tally = {"refused": 0, "accepted": 0}

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(edits)
    # what it found, kept: a deadline past datetime's range broke every reconcile round
    @example([("spec.activeDeadlineSeconds", 10**12)])
    @example([("spec.ttlSecondsAfterFinished", 2**63 - 1)])
    # past index 9999 a pod's hostname can outgrow 63 characters: refused, naming the field
    @example([("spec.maxReplicas", 10001)])
    # env of a wrong type passed the CRD and broke every round (TypeError building the pod)
    @example([(f"{C0}.env", -2)])
    # a template the API server refuses at pod creation: the job said nothing, for ever
    @example([(f"{C0}.name", "Ab")])
    def one(changes: list[tuple[str, Any]]) -> None:
        name = f"h-{uuid.uuid4().hex[:8]}"
        obj = job(name, ["true"], replicas=1, rdzvEndpoint=ENDPOINT)
        for path, value in changes:
            apply_edit(obj, path, value)
        verdict = submit(c, ns, obj)
        shown = "; ".join(f"{p}={json.dumps(v)[:80]}" for p, v in changes)
        if not verdict.accepted:
            tally["refused"] += 1
            names = {field_name(p) for p, _ in changes}
            if not any(n in verdict.detail for n in names):
                problems.append(
                    f"refused without naming {sorted(names)}: {shown}: {verdict.detail[:400]}"
                )
            return
        tally["accepted"] += 1
        created = obj["metadata"]["name"] if isinstance(obj.get("metadata"), dict) else name

        def handled() -> Obj | None:
            status = c.status(ns, created)
            return status if status.get("phase") else None

        try:
            status = wait_for(f"the operator to handle {created}", handled, timeout=60)
        except AssertionError:
            problems.append(f"accepted but never handled: {shown}")
            status = {}
        if status.get("phase") == "Failed":
            failed = next((x for x in status["conditions"] if x["type"] == "Failed"), {})
            message = failed.get("message", "")
            if not message or "\n" in message or len(message) > 1000:
                problems.append(f"failed without a clear message: {shown}: {message[:400]!r}")
        # gone before the next example, which may pick the same name
        c.kubectl("-n", ns, "delete", "elasticjob", created, "--timeout=60s", check=False)
        sick = operator_healthy(installed)
        if sick:
            problems.append(f"after {shown}: {sick}")

    one()
    print(f"hostile jobs: {tally}")
    assert not problems, "\n".join(problems)
    assert tally["refused"] >= 10 and tally["accepted"] >= 5, tally  # both sides exercised

    # Still handles a normal job, and never restarted.
    name = f"normal-{uuid.uuid4().hex[:6]}"
    c.apply(ns, job(name, ["true"], replicas=1))
    wait_for("the normal job to succeed", lambda: c.status(ns, name).get("phase") == "Succeeded")
    assert operator_healthy(installed) is None
