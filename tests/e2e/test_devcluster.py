"""The devcluster behaves like a Kubernetes cluster to its users (issue 2's list).

Pods run `python -c ...` (images are recorded, not pulled). Each test works in its own
namespace and bounds every wait generously: the bounds catch hangs, not speed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import kube_helpers
import pytest
from kubernetes import client, config

from elasticjob_devcluster import cgroups, faults, kubeapi, pod_status

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

T = TypeVar("T")
Obj = dict[str, Any]
WAIT = 90.0


def wait_for(what: str, check: Callable[[], T | None], timeout: float = WAIT) -> T:
    """kube_helpers.wait_for with this module's bound and a quicker poll (pods start fast)."""
    return kube_helpers.wait_for(what, check, timeout, interval=0.3)


@pytest.fixture(scope="module")
def api(kubeconfig: Path) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))  # type: ignore[no-untyped-call]


@pytest.fixture(scope="module")
def rbac(kubeconfig: Path) -> client.RbacAuthorizationV1Api:
    return client.RbacAuthorizationV1Api(config.new_client_from_config(config_file=str(kubeconfig)))  # type: ignore[no-untyped-call]


@pytest.fixture
def ns(api: client.CoreV1Api) -> Iterator[str]:
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    api.create_namespace({"metadata": {"name": name}})
    wait_for(
        "the namespace's default ServiceAccount",
        lambda: api.read_namespaced_service_account("default", name),
    )
    yield name
    api.delete_namespace(name)


@pytest.fixture
def cluster_dir(devcluster: Any) -> Path:
    """The devcluster's directory (fault injection talks to its node agents)."""
    if devcluster is not None:
        return Path(devcluster.dir)
    if os.environ.get("ELASTICJOB_E2E_DEVCLUSTER_DIR"):
        return Path(os.environ["ELASTICJOB_E2E_DEVCLUSTER_DIR"])
    pytest.skip("fault injection needs the devcluster")


def pod_manifest(name: str, script: str, restart: str = "Never", **spec: Any) -> Obj:
    container: Obj = {
        "name": "main",
        "image": kube_helpers.RUNTIME_IMAGE,
        "command": ["python", "-u", "-c", textwrap.dedent(script)],
    }
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **spec.pop("metadata", {})},
        "spec": {"restartPolicy": restart, "containers": [container], **spec},
    }


def create(api: client.CoreV1Api, ns: str, manifest: Obj) -> None:
    api.create_namespaced_pod(ns, manifest)


def phase(api: client.CoreV1Api, ns: str, name: str) -> str:
    return str(api.read_namespaced_pod(name, ns).status.phase)


def wait_phase(api: client.CoreV1Api, ns: str, name: str, want: str) -> client.V1Pod:
    def check() -> client.V1Pod | None:
        pod = api.read_namespaced_pod(name, ns)
        assert want == "Failed" or pod.status.phase != "Failed", pod.status
        return pod if pod.status.phase == want else None

    return wait_for(f"pod {name} to be {want}", check)


def wait_deleted(api: client.CoreV1Api, ns: str, name: str) -> None:
    def gone() -> bool:
        try:
            api.read_namespaced_pod(name, ns)
            return False
        except client.ApiException as e:
            return e.status == 404

    wait_for(f"pod {name} to be deleted", gone)


def logs(api: client.CoreV1Api, ns: str, name: str, **kw: Any) -> str:
    return str(api.read_namespaced_pod_log(name, ns, **kw))


def kubectl(kubeconfig: Path, *args: str, timeout: float = 60) -> str:
    exe = shutil.which("kubectl") or str(Path.home() / ".cache/elasticjob/tools/kubectl")
    out = subprocess.run(
        [exe, f"--kubeconfig={kubeconfig}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return out.stdout


def test_pod_runs_to_succeeded(api: client.CoreV1Api, ns: str) -> None:
    create(api, ns, pod_manifest("ok", "print('done')"))
    pod = wait_phase(api, ns, "ok", "Succeeded")
    state = pod.status.container_statuses[0].state.terminated
    assert state.exit_code == 0 and state.reason == "Completed"
    assert pod.status.pod_ip and pod.spec.node_name

    def reasons() -> set[str] | None:
        got = {e.reason for e in api.list_namespaced_event(ns).items}
        return got if {"Scheduled", "Started"} <= got else None

    wait_for("Scheduled and Started events", reasons)


def test_a_command_that_does_not_exist_fails_with_start_error(
    api: client.CoreV1Api, ns: str
) -> None:
    manifest = pod_manifest("typo", "", container={"command": ["no-such-command-xyz"]})
    create(api, ns, manifest)
    pod = wait_phase(api, ns, "typo", "Failed")
    terminated = pod.status.container_statuses[0].state.terminated
    assert terminated.reason == "StartError" and "no-such-command-xyz" in terminated.message


def test_a_container_with_args_only_runs_its_images_entrypoint(
    api: client.CoreV1Api, ns: str
) -> None:
    """No command: the image's ENTRYPOINT runs the args, as on a node; the runtime
    image's is elasticjob-run."""
    manifest = pod_manifest("entry", "")
    [container] = manifest["spec"]["containers"]
    del container["command"]
    container["args"] = ["--help"]
    create(api, ns, manifest)
    wait_phase(api, ns, "entry", "Succeeded")
    assert logs(api, ns, "entry").startswith("usage: elasticjob-run ")


def waiting(api: client.CoreV1Api, ns: str, name: str, reason: str) -> Any:
    def check() -> Any:
        statuses = api.read_namespaced_pod(name, ns).status.container_statuses or []
        state = statuses[0].state.waiting if statuses else None
        return state if state is not None and state.reason == reason else None

    return wait_for(f"pod {name} to wait {reason}", check)


def test_an_image_it_cannot_run_or_parse_waits_with_kubelets_reason(
    api: client.CoreV1Api, ns: str
) -> None:
    """An image without a command whose ENTRYPOINT is unknown fails to pull and backs off;
    a reference that does not parse is InvalidImageName. The pod stays Pending."""
    unknown = pod_manifest("pull", "")
    [container] = unknown["spec"]["containers"]
    del container["command"]
    container.update({"image": "torchelastic/examples:0.2.0", "args": ["main.py"]})
    create(api, ns, unknown)
    backoff = waiting(api, ns, "pull", "ImagePullBackOff")
    # a real kubelet adds the pull's error after a colon (kind: the registry's name does
    # not resolve behind the fence)
    expected = 'Back-off pulling image "torchelastic/examples:0.2.0"'
    message = backoff.message or ""
    assert message == expected or message.startswith(f"{expected}: "), message
    invalid = pod_manifest("badref", "print('never')", container={"image": "Not/Valid:x"})
    create(api, ns, invalid)
    bad = waiting(api, ns, "badref", "InvalidImageName")
    assert "invalid reference format" in bad.message
    for name in ("pull", "badref"):
        assert phase(api, ns, name) == "Pending"
    wanted = {
        ("pull", "Failed", "Error: ErrImagePull"),
        ("pull", "Failed", "Error: ImagePullBackOff"),
        ("badref", "Failed", "Error: InvalidImageName"),
    }

    def said() -> bool:
        events = api.list_namespaced_event(ns).items
        return wanted <= {(e.involved_object.name, e.reason, e.message) for e in events}

    wait_for("kubelet's events about the images", said)


def test_pod_exiting_3_is_failed_with_exit_code_3(api: client.CoreV1Api, ns: str) -> None:
    create(api, ns, pod_manifest("three", "import sys; sys.exit(3)"))
    pod = wait_phase(api, ns, "three", "Failed")
    assert pod.status.container_statuses[0].state.terminated.exit_code == 3


def test_on_failure_restarts_with_restart_count_rising(api: client.CoreV1Api, ns: str) -> None:
    create(api, ns, pod_manifest("crash", "import sys; sys.exit(1)", restart="OnFailure"))

    def restarted_twice() -> int | None:
        statuses = api.read_namespaced_pod("crash", ns).status.container_statuses or []
        n = statuses[0].restart_count if statuses else 0
        return n if n >= 2 else None

    wait_for("restartCount >= 2", restarted_twice)
    assert phase(api, ns, "crash") == "Running"
    last = api.read_namespaced_pod("crash", ns).status.container_statuses[0].last_state
    assert last.terminated.exit_code == 1


SERVE_8080 = """
    import http.server, socket
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
            self.wfile.write(socket.gethostname().encode())
    http.server.HTTPServer(("0.0.0.0", 8080), H).serve_forever()
"""


def test_a_status_written_from_a_stale_read_keeps_another_writers_condition(
    api: client.CoreV1Api, ns: str
) -> None:
    """The node agent writes its conditions whole (a merge patch) from its watch cache. An
    eviction's DisruptionTarget added after that cache was read must survive the write
    (once in a full run, the drained worker of a backoffLimit 0 job was counted failed):
    a patch from the stale read is refused, and the agent's own next write, when the
    container exits, keeps the condition."""
    create(api, ns, pod_manifest("taken", "import time; time.sleep(4)"))
    wait_phase(api, ns, "taken", "Running")
    stale = kubeapi.raw(api.read_namespaced_pod("taken", ns, _preload_content=False))
    disruption = {
        "type": "DisruptionTarget",
        "status": "True",
        "reason": "EvictionByEvictionAPI",
        "message": "Eviction API: evicting",
        "lastTransitionTime": pod_status.rfc3339(time.time()),
    }
    api.patch_namespaced_pod_status(  # strategic merge, as the eviction does: merged by type
        "taken", ns, {"status": {"conditions": [disruption]}}
    )
    with pytest.raises(client.ApiException) as refused:
        api.patch_namespaced_pod_status(
            "taken",
            ns,
            pod_status.status_patch(stale, stale["status"]),
            _content_type=kubeapi.MERGE_PATCH,
        )
    assert refused.value.status == 409, refused.value
    pod = wait_phase(api, ns, "taken", "Succeeded")
    kept = [c for c in pod.status.conditions if c.type == "DisruptionTarget"]
    assert [c.reason for c in kept] == ["EvictionByEvictionAPI"], pod.status.conditions


def test_pod_reaches_another_by_service_name_on_the_same_port(
    api: client.CoreV1Api, ns: str
) -> None:
    server = pod_manifest(
        "server",
        SERVE_8080,
        metadata={"labels": {"app": "web"}},
        container={
            "ports": [{"name": "http", "containerPort": 8080}],
            "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 1},
        },
    )
    create(api, ns, server)
    api.create_namespaced_service(
        ns,
        {
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "http"}]},
        },
    )
    client_script = f"""
        import os, socket, time, urllib.request
        # this pod listens on 8080 and 80 too: pods have their own network namespaces,
        # and the Service's port is not taken in the client's
        for port in (8080, 80):
            srv = socket.socket(); srv.bind(("0.0.0.0", port)); srv.listen()
        env_url = "http://" + os.environ["WEB_SERVICE_HOST"] + ":" + os.environ["WEB_SERVICE_PORT"]
        names = ("http://web", "http://web.{ns}", "http://web.{ns}.svc.cluster.local:80")
        for url in (*names, env_url):
            for _ in range(200):
                try:
                    body = urllib.request.urlopen(url + "/", timeout=2).read()
                    print(url, body.decode()); break
                except OSError:
                    time.sleep(0.3)
            else:
                raise SystemExit(f"{{url}} never answered")
    """
    create(api, ns, pod_manifest("client", client_script))
    wait_phase(api, ns, "client", "Succeeded")
    out = logs(api, ns, "client").splitlines()
    assert out[0] == "http://web server"
    assert f"http://web.{ns}.svc.cluster.local:80 server" in out
    cluster_ip = api.read_namespaced_service("web", ns).spec.cluster_ip
    assert out[-1] == f"http://{cluster_ip}:80 server"
    a = api.read_namespaced_pod("server", ns).status.pod_ip
    b = api.read_namespaced_pod("client", ns).status.pod_ip
    assert a and b and a != b


def test_deleting_a_pod_delivers_sigterm_first(
    api: client.CoreV1Api, ns: str, kubeconfig: Path
) -> None:
    """The handler's word reaches `kubectl logs -f`, which follows the pod through its
    deletion, as a user watching it would see it."""
    script = """
        import signal, sys, time
        def term(signum, frame):
            print("SIGTERM", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, term)
        print("ready", flush=True)
        while True:
            time.sleep(0.1)
    """
    create(api, ns, pod_manifest("graceful", script, terminationGracePeriodSeconds=60))
    wait_for("the pod to be running its handler", lambda: logs(api, ns, "graceful") == "ready\n")
    exe = shutil.which("kubectl") or str(Path.home() / ".cache/elasticjob/tools/kubectl")
    follow = subprocess.Popen(
        [exe, "--kubeconfig", str(kubeconfig), "-n", ns, "logs", "-f", "graceful"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert follow.stdout is not None
        assert follow.stdout.readline() == "ready\n"  # following before the delete
        started = time.monotonic()
        api.delete_namespaced_pod("graceful", ns)
        rest, _ = follow.communicate(timeout=60)
    finally:
        follow.kill()
    wait_deleted(api, ns, "graceful")
    assert rest == "SIGTERM\n"
    assert time.monotonic() - started < 30, "the kubelet waited for the grace period, not the exit"


def test_deleting_an_owner_garbage_collects_its_pods(api: client.CoreV1Api, ns: str) -> None:
    owner = api.create_namespaced_config_map(ns, {"metadata": {"name": "owner"}})
    ref = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner.metadata.uid,
    }
    create(
        api,
        ns,
        pod_manifest("owned", "import time; time.sleep(600)", metadata={"ownerReferences": [ref]}),
    )
    wait_phase(api, ns, "owned", "Running")
    api.delete_namespaced_config_map("owner", ns, propagation_policy="Background")

    def collected() -> bool:
        return not api.list_namespaced_pod(ns).items

    wait_for("the garbage collector to delete the owned pod", collected)


def test_service_account_rights_come_from_rbac(
    api: client.CoreV1Api, rbac: client.RbacAuthorizationV1Api, ns: str
) -> None:
    api.create_namespaced_service_account(ns, {"metadata": {"name": "reader"}})
    # the pod's own token and CA, as any in-cluster client uses them (stdlib only)
    script = f"""
        import json, os, ssl, urllib.error, urllib.request
        sa = "/var/run/secrets/kubernetes.io/serviceaccount/"
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
        request = urllib.request.Request(
            f"https://{{host}}:{{port}}/api/v1/namespaces/{ns}/pods",
            headers={{"Authorization": "Bearer " + open(sa + "token").read().strip()}},
        )
        trusted = ssl.create_default_context(cafile=sa + "ca.crt")
        try:
            with urllib.request.urlopen(request, context=trusted) as r:
                print("allowed", len(json.load(r)["items"]))
        except urllib.error.HTTPError as e:
            print("status", e.code)
    """
    create(api, ns, pod_manifest("before", script, serviceAccountName="reader"))
    wait_phase(api, ns, "before", "Succeeded")
    assert logs(api, ns, "before").strip() == "status 403"
    rbac.create_namespaced_role(
        ns,
        {
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        ns,
        {
            "metadata": {"name": "reader-reads"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "pod-reader",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}],
        },
    )
    create(api, ns, pod_manifest("after", script, serviceAccountName="reader"))
    wait_phase(api, ns, "after", "Succeeded")
    assert logs(api, ns, "after").startswith("allowed ")


def test_kubectl_logs_returns_the_output(api: client.CoreV1Api, ns: str, kubeconfig: Path) -> None:
    script = """
        import sys, time
        for i in range(5):
            print("line", i)
            time.sleep(0.4)
        print("to stderr", file=sys.stderr)
    """
    create(api, ns, pod_manifest("talk", script))
    wait_phase(api, ns, "talk", "Running")
    followed = kubectl(kubeconfig, "-n", ns, "logs", "-f", "talk")
    want = "".join(f"line {i}\n" for i in range(5)) + "to stderr\n"
    assert followed == want
    wait_phase(api, ns, "talk", "Succeeded")
    assert kubectl(kubeconfig, "-n", ns, "logs", "talk") == want
    assert kubectl(kubeconfig, "-n", ns, "logs", "--tail=1", "talk") == "to stderr\n"
    assert kubectl(kubeconfig, "-n", ns, "logs", "--limit-bytes=6", "talk") == "line 0"
    assert kubectl(kubeconfig, "-n", ns, "logs", "--since=1h", "talk") == want
    stamped = kubectl(kubeconfig, "-n", ns, "logs", "--timestamps", "talk").splitlines()
    assert stamped[0].endswith(" line 0") and stamped[0][:4].isdigit()


def test_env_from_field_ref_configmap_and_secret_arrives(api: client.CoreV1Api, ns: str) -> None:
    api.create_namespaced_config_map(ns, {"metadata": {"name": "cfg"}, "data": {"color": "blue"}})
    api.create_namespaced_secret(
        ns, {"metadata": {"name": "sec"}, "stringData": {"token": "s3cret"}}
    )
    env = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "COLOR", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "color"}}},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "token"}}},
        {"name": "GREETING", "value": "hello $(POD_NAME)"},
    ]
    script = """
        import json, os
        keys = ["POD_NAME", "POD_NS", "POD_IP", "COLOR", "TOKEN", "GREETING", "cfg_color"]
        print(json.dumps({k: os.environ.get(k) for k in keys}))
    """
    container = {"env": env, "envFrom": [{"prefix": "cfg_", "configMapRef": {"name": "cfg"}}]}
    create(api, ns, pod_manifest("envs", script, container=container))
    pod = wait_phase(api, ns, "envs", "Succeeded")
    import json

    got = json.loads(logs(api, ns, "envs"))
    assert got == {
        "POD_NAME": "envs",
        "POD_NS": ns,
        "POD_IP": pod.status.pod_ip,
        "COLOR": "blue",
        "TOKEN": "s3cret",
        "GREETING": "hello envs",
        "cfg_color": "blue",
    }


def test_init_containers_run_first_in_order(api: client.CoreV1Api, ns: str) -> None:
    mount = [{"name": "work", "mountPath": "/work"}]

    def step(name: str) -> Obj:
        return {
            "name": name,
            "image": kube_helpers.RUNTIME_IMAGE,
            "command": ["python", "-c", f"open('/work/order', 'a').write('{name} ')"],
            "volumeMounts": mount,
        }

    manifest = pod_manifest(
        "inits",
        "print(open('/work/order').read() + 'main')",
        container={"volumeMounts": mount},
        volumes=[{"name": "work", "emptyDir": {}}],
        initContainers=[step("first"), step("second")],
    )
    create(api, ns, manifest)
    wait_phase(api, ns, "inits", "Succeeded")
    assert logs(api, ns, "inits", container="main").strip() == "first second main"


# -- /dev/shm: a memory emptyDir is a tmpfs of its sizeLimit; without one, 64 MiB as on
# containerd. The writer fills half of an 8 MiB limit, then fails to write 8 MiB more.
SHM_WRITER = """
import errno, os
st = os.statvfs('/dev/shm')
print(f'size={st.f_blocks * st.f_frsize}', flush=True)
with open('/dev/shm/half', 'wb') as f:
    f.write(b'x' * (4 << 20))
try:
    with open('/dev/shm/more', 'wb') as f:
        f.write(b'x' * (8 << 20))
    print('wrote past the limit')
except OSError as e:
    print('ENOSPC' if e.errno == errno.ENOSPC else f'error {e}')
os.remove('/dev/shm/more')
open('/dev/shm/done', 'w').close()
mounts = [line.split()[4] for line in open('/proc/self/mountinfo')]
print('other pods mounts: ' + ','.join(m for m in mounts if '/pods/' in m))
"""
SHM_READER = """
import os, time
deadline = time.time() + 60
while not os.path.exists('/dev/shm/done') and time.time() < deadline:
    time.sleep(0.1)
print(f'half={os.path.getsize("/dev/shm/half")}')
"""


def host_mounts_of(uid: str) -> list[str]:
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if uid in line]


def test_memory_empty_dir_is_a_tmpfs_of_its_size_limit_shared_by_the_pods_containers(
    api: client.CoreV1Api, ns: str, devcluster: Any
) -> None:
    shm = [{"name": "dshm", "mountPath": "/dev/shm"}]
    manifest = pod_manifest(
        "shm",
        SHM_WRITER,
        container={"name": "writer", "volumeMounts": shm},
        volumes=[{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Mi"}}],
    )
    reader = {"name": "reader", "image": kube_helpers.RUNTIME_IMAGE, "volumeMounts": shm}
    manifest["spec"]["containers"].append(
        {**reader, "command": ["python", "-u", "-c", textwrap.dedent(SHM_READER)]}
    )
    create(api, ns, manifest)
    pod = wait_phase(api, ns, "shm", "Succeeded")
    assert logs(api, ns, "shm", container="writer").splitlines() == [
        f"size={8 << 20}",
        "ENOSPC",  # not an eviction: the tmpfs is the limit
        "other pods mounts: ",  # no copy of another pod's tmpfs keeps its memory alive
    ]
    assert logs(api, ns, "shm", container="reader") == f"half={4 << 20}\n"
    if devcluster is not None:  # the node let go of the tmpfs with the pod
        wait_for("the pod's tmpfs to be unmounted", lambda: not host_mounts_of(pod.metadata.uid))


def test_a_pod_without_its_own_dev_shm_gets_a_private_64_mib_one(
    api: client.CoreV1Api, ns: str
) -> None:
    script = """
        import os
        s = os.statvfs('/dev/shm')
        print(s.f_blocks * s.f_frsize, os.listdir('/dev/shm'))
    """
    create(api, ns, pod_manifest("small-shm", script))
    wait_phase(api, ns, "small-shm", "Succeeded")
    assert logs(api, ns, "small-shm") == f"{64 << 20} []\n"


def test_failing_liveness_probe_restarts_the_container(api: client.CoreV1Api, ns: str) -> None:
    probe = {"tcpSocket": {"port": 9}, "periodSeconds": 1, "failureThreshold": 1}
    manifest = pod_manifest(
        "unhealthy", "import time; time.sleep(600)", container={"livenessProbe": probe}
    )
    create(api, ns, {**manifest, "spec": {**manifest["spec"], "restartPolicy": "Always"}})

    def restarted() -> bool:
        statuses = api.read_namespaced_pod("unhealthy", ns).status.container_statuses or []
        return bool(statuses and statuses[0].restart_count >= 1)

    wait_for("the unhealthy container to be restarted", restarted)


def test_a_startup_probe_holds_liveness_back_until_it_passes_and_kills_what_never_starts(
    api: client.CoreV1Api, ns: str
) -> None:
    """kubelet's startupProbe: no liveness probe runs before it succeeded once (a slow
    start is not a hang), and a container that never passes it is killed like one
    failing liveness."""
    slow = "import time; time.sleep(3)\n" + textwrap.dedent(SERVE_8080_SAY_PID)
    liveness = {"tcpSocket": {"port": 8080}, "periodSeconds": 1, "failureThreshold": 1}
    startup = {"tcpSocket": {"port": 8080}, "periodSeconds": 1, "failureThreshold": 30}
    create(
        api,
        ns,
        pod_manifest(
            "slow-start",
            slow,
            restart="Always",
            container={"livenessProbe": liveness, "startupProbe": startup},
        ),
    )
    never = {**startup, "tcpSocket": {"port": 9}, "failureThreshold": 2}
    create(
        api,
        ns,
        pod_manifest(
            "never-starts",
            "import time; time.sleep(600)",
            restart="Always",
            container={"startupProbe": never},
        ),
    )

    def status(name: str) -> Any:
        statuses = api.read_namespaced_pod(name, ns).status.container_statuses or []
        return statuses[0] if statuses else None

    wait_for(
        "never-starts to be killed by its startup probe",
        lambda: ((cs := status("never-starts")) is not None and cs.restart_count >= 1) or None,
    )
    wait_for(
        "slow-start to pass its startup probe",
        lambda: ((cs := status("slow-start")) is not None and cs.started) or None,
    )
    time.sleep(2)  # liveness now probes a server that answers
    cs = status("slow-start")
    assert cs.restart_count == 0 and cs.state.running, cs


def test_a_pod_no_node_fits_says_why_it_is_pending(api: client.CoreV1Api, ns: str) -> None:
    create(api, ns, pod_manifest("nowhere", "pass", nodeSelector={"disk": "floppy"}))

    def unschedulable() -> str | None:
        for c in api.read_namespaced_pod("nowhere", ns).status.conditions or []:
            if c.type == "PodScheduled" and c.status == "False":
                return str(c.message)
        return None

    message = wait_for("PodScheduled=False", unschedulable)
    assert "didn't match Pod's node affinity/selector" in message
    assert phase(api, ns, "nowhere") == "Pending"


def test_a_claim_is_bound_and_shared_by_the_pods_that_mount_it(
    api: client.CoreV1Api, ns: str
) -> None:
    default = [
        sc
        for sc in client.StorageV1Api(api.api_client).list_storage_class().items
        if (sc.metadata.annotations or {}).get("storageclass.kubernetes.io/is-default-class")
        == "true"
    ]
    if [sc.provisioner for sc in default] == ["kubernetes.io/host-path"]:
        pytest.skip(
            "a ReadWriteMany claim shared across nodes needs shared storage; this cluster's "
            "default StorageClass makes host-path volumes, each on one node (kind's)"
        )
    api.create_namespaced_persistent_volume_claim(
        ns,
        {
            "metadata": {"name": "ckpt"},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )

    def bound() -> bool:
        return bool(api.read_namespaced_persistent_volume_claim("ckpt", ns).status.phase == "Bound")

    wait_for("the claim to be Bound", bound)
    volume = {"name": "data", "persistentVolumeClaim": {"claimName": "ckpt"}}
    mount = {"volumeMounts": [{"name": "data", "mountPath": "/ckpt"}]}
    write = "open('/ckpt/step', 'w').write('42')"
    create(api, ns, pod_manifest("writer", write, container=mount, volumes=[volume]))
    wait_phase(api, ns, "writer", "Succeeded")
    read = "print(open('/ckpt/step').read())"
    create(api, ns, pod_manifest("reader", read, container=mount, volumes=[volume]))
    wait_phase(api, ns, "reader", "Succeeded")
    assert logs(api, ns, "reader") == "42\n"


def test_fault_kill_restarts_the_container(
    api: client.CoreV1Api, ns: str, cluster_dir: Path
) -> None:
    script = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(600)"
    create(api, ns, pod_manifest("victim", script, restart="Always"))
    wait_phase(api, ns, "victim", "Running")
    wait_for("the victim to print its pid", lambda: logs(api, ns, "victim").startswith("pid "))
    killed = faults.kill_container(cluster_dir, ns, "victim")
    assert len(killed) == 1

    def restarted() -> bool:
        cs = api.read_namespaced_pod("victim", ns).status.container_statuses[0]
        return bool(cs.restart_count >= 1 and cs.state.running)

    wait_for("the killed container to be restarted", restarted)
    last = api.read_namespaced_pod("victim", ns).status.container_statuses[0].last_state
    assert last.terminated.exit_code == 137
    assert logs(api, ns, "victim", previous=True) == f"pid {killed[0]}\n"
    wait_for("the new run's output", lambda: logs(api, ns, "victim").startswith("pid "))
    assert logs(api, ns, "victim") != f"pid {killed[0]}\n"


# an HTTP server that prints its pid once it listens (before that, probes fail), and
# nothing else
SERVE_8080_SAY_PID = """
    import http.server, os
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("0.0.0.0", 8080), H)
    print("pid", os.getpid(), flush=True)
    server.serve_forever()
"""


def serving_pid(api: client.CoreV1Api, ns: str, name: str) -> int:
    def pid() -> int | None:
        m = re.fullmatch(r"pid (\d+)\n", logs(api, ns, name))
        return int(m.group(1)) if m else None

    return wait_for(f"{name} to serve", pid)


def test_fault_freeze_fails_the_liveness_probe_and_the_container_is_restarted(
    api: client.CoreV1Api, ns: str, cluster_dir: Path
) -> None:
    probe = {
        "httpGet": {"port": 8080, "path": "/"},
        "periodSeconds": 1,
        "timeoutSeconds": 1,
        "failureThreshold": 3,
    }
    manifest = pod_manifest(
        "hangs", SERVE_8080_SAY_PID, restart="Always", container={"livenessProbe": probe}
    )
    create(api, ns, manifest)
    pid = serving_pid(api, ns, "hangs")
    time.sleep(3)  # the probe has passed a few times: the server alone keeps it alive
    assert api.read_namespaced_pod("hangs", ns).status.container_statuses[0].restart_count == 0
    assert faults.freeze_container(cluster_dir, ns, "hangs") == pid
    wait_for("the process to stop", lambda: process_state(pid) == "T")

    def restarted() -> bool:
        cs = api.read_namespaced_pod("hangs", ns).status.container_statuses[0]
        return bool(cs.restart_count >= 1 and cs.state.running)

    wait_for("the frozen container to fail liveness and be restarted", restarted)
    last = api.read_namespaced_pod("hangs", ns).status.container_statuses[0].last_state
    assert last.terminated.exit_code == 137  # SIGKILL, which a stopped process obeys
    assert logs(api, ns, "hangs", previous=True) == f"pid {pid}\n"
    assert not process_alive(pid)


def test_fault_freeze_and_thaw_and_a_frozen_pod_is_still_deleted(
    api: client.CoreV1Api, ns: str, cluster_dir: Path
) -> None:
    manifest = pod_manifest("stuck", SERVE_8080_SAY_PID, terminationGracePeriodSeconds=2)
    create(api, ns, manifest)
    pid = serving_pid(api, ns, "stuck")
    assert faults.freeze_container(cluster_dir, ns, "stuck", "main") == pid
    wait_for("the process to stop", lambda: process_state(pid) == "T")  # signals are async
    assert faults.thaw_container(cluster_dir, ns, "stuck") == pid
    wait_for("the thawed process to run again", lambda: process_state(pid) in ("S", "R"))
    faults.freeze_container(cluster_dir, ns, "stuck")
    wait_for("the process to stop again", lambda: process_state(pid) == "T")
    # its SIGTERM stays pending while it is stopped: the grace period ends in SIGKILL
    api.delete_namespaced_pod("stuck", ns)
    wait_deleted(api, ns, "stuck")
    assert not process_alive(pid)


def test_fault_cut_network_stops_traffic_until_restored(
    api: client.CoreV1Api, ns: str, cluster_dir: Path
) -> None:
    create(api, ns, pod_manifest("server", SERVE_8080, metadata={"labels": {"app": "s"}}))
    server_ip = wait_phase(api, ns, "server", "Running").status.pod_ip
    probe = f"""
        import socket, time
        while True:
            try:
                socket.create_connection(("{server_ip}", 8080), timeout=0.5).close()
                print("ok", flush=True)
            except OSError:
                print("fail", flush=True)
            time.sleep(0.3)
    """
    create(api, ns, pod_manifest("prober", probe))
    wait_for("first successful connection", lambda: "ok" in logs(api, ns, "prober"))
    faults.cut_network(cluster_dir, ns, "server")
    wait_for("connections to fail", lambda: logs(api, ns, "prober", tail_lines=1) == "fail\n")
    faults.restore_network(cluster_dir, ns, "server")
    wait_for("connections to work again", lambda: logs(api, ns, "prober", tail_lines=1) == "ok\n")


def test_fault_node_not_ready_and_back(api: client.CoreV1Api, cluster_dir: Path) -> None:
    node = sorted(n.metadata.name for n in api.list_node().items)[-1]

    def ready() -> str:
        n = api.read_node(node)
        return next(c.status for c in n.status.conditions if c.type == "Ready")

    faults.set_node_ready(cluster_dir, node, False)
    wait_for("the node to be NotReady", lambda: ready() != "True")
    faults.set_node_ready(cluster_dir, node, True)
    wait_for("the node to be Ready again", lambda: ready() == "True")


@pytest.mark.slow
def test_lost_node_goes_not_ready_and_its_pods_die(devcluster: Any, tmp_path: Path) -> None:
    """On a cluster of its own: a lost node cannot come back, so the shared one is spared."""
    if devcluster is None:
        pytest.skip("losing a node needs the devcluster")
    cluster = type(devcluster)(tmp_path / "lossy")
    cluster.up(("doomed",))
    try:
        api = client.CoreV1Api(config.new_client_from_config(config_file=str(cluster.kubeconfig)))  # type: ignore[no-untyped-call]
        create(api, "default", pod_manifest("gone", "import time; time.sleep(600)"))
        wait_phase(api, "default", "gone", "Running")
        pids = [r.pid for r in cluster.leftover_processes() if r.name.startswith("pod ")]
        faults.lose_node(cluster.dir, "doomed")

        def node_not_ready() -> bool:
            conds = api.read_node("doomed").status.conditions
            return next(c.status for c in conds if c.type == "Ready") != "True"

        wait_for("the lost node to go NotReady", node_not_ready)
        assert pids and not any(Path(f"/proc/{pid}").exists() for pid in pids)

        def pod_not_ready() -> bool:
            pod = api.read_namespaced_pod("gone", "default")
            return next(c.status for c in pod.status.conditions if c.type == "Ready") == "False"

        # marked by the node lifecycle controller: the lost agent writes nothing any more
        wait_for("the lost node's pod to be marked not ready", pod_not_ready)
    finally:
        cluster.down()
        assert not cluster.leftover_processes()


# -- stopping a container stops everything it started (cgroups, not process groups) --
# The container starts a grandchild in a new session (like a torch worker) and reports it.
SPAWN_DETACHED = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
    "print(f'detached={child.pid}', flush=True)\n"
    "time.sleep(600)\n"
)


def process_state(pid: int) -> str:
    """R, S, T (stopped), Z... from /proc/<pid>/stat; "" once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def process_alive(pid: int) -> bool:
    return process_state(pid) not in ("", "Z")


def detached_pid(api: client.CoreV1Api, ns: str, name: str) -> int:
    def find() -> int | None:
        m = re.search(r"detached=(\d+)", logs(api, ns, name))
        return int(m.group(1)) if m else None

    pid = wait_for("the pod to report its detached child", find)
    assert process_alive(pid)
    return pid


@pytest.fixture
def needs_cgroups(devcluster: Any) -> None:
    if devcluster is None:
        pytest.skip(
            "looks for the pod's processes in this machine's /proc: only the devcluster's "
            "pods are processes of this machine (a container runtime kills a container's "
            "whole cgroup itself)"
        )
    if cgroups.hierarchy() is None:
        pytest.skip("no writable cgroup v2 hierarchy on this machine")


@pytest.mark.usefixtures("needs_cgroups")
def test_killing_a_container_kills_children_in_other_sessions(
    api: client.CoreV1Api, ns: str, cluster_dir: Path
) -> None:
    create(api, ns, pod_manifest("detach", SPAWN_DETACHED))
    wait_phase(api, ns, "detach", "Running")
    pid = detached_pid(api, ns, "detach")
    faults.kill_container(cluster_dir, ns, "detach")
    wait_phase(api, ns, "detach", "Failed")
    wait_for(f"detached child {pid} to be gone", lambda: not process_alive(pid), timeout=30)


@pytest.mark.usefixtures("needs_cgroups")
def test_deleting_a_pod_kills_children_in_other_sessions(api: client.CoreV1Api, ns: str) -> None:
    create(api, ns, pod_manifest("detach-del", SPAWN_DETACHED, terminationGracePeriodSeconds=2))
    wait_phase(api, ns, "detach-del", "Running")
    pid = detached_pid(api, ns, "detach-del")
    api.delete_namespaced_pod("detach-del", ns)
    wait_for(f"detached child {pid} to be gone", lambda: not process_alive(pid), timeout=60)
