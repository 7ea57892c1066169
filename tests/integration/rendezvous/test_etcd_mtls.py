"""A job's etcd with mutual TLS, as the operator runs it: a real etcd started with
client-certificate auth and the certificates the operator issues; real elasticjob-run
agents rendezvous and publish progress through it, and every other client is refused
with one line saying what to check.

Run as a script, this module is the worker: rendezvous (gloo over the etcd store),
publish progress from rank 0 (``progress.reporter_from_env``) and hold it until the test
creates ``$RDZV_TEST_OUT/stop``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest
from conftest import EtcdServer, read_progress, start, wait_for
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
)

from elasticjob_operator import observe
from elasticjob_operator.etcd import certs as etcd_certs
from elasticjob_operator.etcd import reader as etcd_reader
from elasticjob_runtime import contract
from elasticjob_runtime.etcd.client import EtcdError, EtcdTLSError
from elasticjob_runtime.etcd.endpoints import parse_endpoints
from elasticjob_runtime.etcd.tls import EtcdTLS, connect, credentials, open_client, tls_environ
from elasticjob_runtime.rendezvous.handler import handler_from_params

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEP = 7


def tls_of(etcd: EtcdServer) -> EtcdTLS:
    assert etcd.tls is not None
    return etcd.tls


def test_a_run_rendezvouses_and_publishes_progress_over_mutual_tls(
    etcd_mtls: EtcdServer, agents: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """What the operator gives a worker pod: an https:// endpoint and ELASTICJOB_ETCD_*."""
    run_id = f"mtls-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "agent.log"
    env = {**tls_environ(tls_of(etcd_mtls)), "RDZV_TEST_OUT": str(tmp_path)}
    agent = start(agents, etcd_mtls, log, [__file__], nproc=2, env=env, run_id=run_id)
    client = open_client(parse_endpoints(etcd_mtls.endpoint), tls_of(etcd_mtls), timeout=5)
    try:
        progress = wait_for(
            "progress published over TLS",
            lambda: p if (p := read_progress(client, run_id)) and p.step == STEP else None,
            120,
            log,
        )
        assert progress.world_size == 2
        # the rendezvous itself went through this etcd: its round and members are there
        assert client.snapshot(contract.run_prefix(run_id)).items
        # the operator's reader, with the client certificate from the job's Secret
        creds = credentials(tls_of(etcd_mtls))
        records = etcd_reader.read_run_records(etcd_mtls.endpoint, run_id, tls=creds)
        seen = observe.progress_of(records.progress)
        assert seen is not None and seen.step == STEP
        # without the certificate the operator's reader sees nothing (and does not fail)
        assert etcd_reader.read_run_records(etcd_mtls.endpoint, run_id).progress is None
        (tmp_path / "stop").touch()
        assert agent.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        client.close()


def test_torchs_rdzv_conf_keys_carry_the_tls_to_the_rendezvous_and_the_workers(
    etcd_mtls: EtcdServer, agents: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """--rdzv-conf cacert=,cert=,key= (torch's etcd rendezvous's names), no variables: the
    launcher hands the files on to its workers, whose progress arrives."""
    tls = tls_of(etcd_mtls)
    run_id = f"mtls-conf-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "agent.log"
    conf = f"--rdzv-conf=protocol=https,cacert={tls.cacert},cert={tls.cert},key={tls.key}"
    bare = etcd_mtls.endpoint.removeprefix("https://")
    server = replace(etcd_mtls, endpoint=bare)  # protocol=https says it, not the endpoint
    without = {k: "" for k in tls_environ(tls)}
    env = {**without, "RDZV_TEST_OUT": str(tmp_path)}
    agent = start(
        agents, server, log, [__file__], nproc=1, env=env, run_id=run_id, launcher_flags=(conf,)
    )
    client = open_client(parse_endpoints(bare), tls, timeout=5)
    try:
        wait_for(
            "progress published over TLS",
            lambda: p if (p := read_progress(client, run_id)) and p.step == STEP else None,
            120,
            log,
        )
        (tmp_path / "stop").touch()
        assert agent.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        client.close()


def refusal(endpoint: str, tls: EtcdTLS | None) -> str:
    client = open_client(parse_endpoints(endpoint), tls, timeout=5)
    try:
        with pytest.raises(EtcdError) as info:
            client.put("/elasticjob/intruder", b"x")
        return str(info.value)
    finally:
        client.close()


def other_jobs_files(where: Path) -> EtcdTLS:
    issued = etcd_certs.issue("other", "ml", "other-etcd", "other-worker", datetime.now(UTC))
    where.mkdir(parents=True, exist_ok=True)
    for name in ("ca_cert", "client_cert", "client_key"):
        (where / name).write_bytes(getattr(issued, name))
    return EtcdTLS(str(where / "ca_cert"), str(where / "client_cert"), str(where / "client_key"))


def test_a_client_without_the_jobs_certificate_is_refused_with_one_clear_line(
    etcd_mtls: EtcdServer, tmp_path: Path
) -> None:
    tls, endpoint = tls_of(etcd_mtls), etcd_mtls.endpoint
    where = endpoint.removeprefix("https://")
    other = other_jobs_files(tmp_path / "other")

    no_cert = refusal(endpoint, EtcdTLS(cacert=tls.cacert))
    assert no_cert == (
        f"cannot connect to etcd at {where} over TLS: etcd asks for a client certificate "
        "and none was given; set ELASTICJOB_ETCD_CERT and ELASTICJOB_ETCD_KEY (or "
        "--rdzv-conf cert=...,key=...)"
    )
    another_job = refusal(endpoint, replace(other, cacert=tls.cacert))
    assert another_job.startswith(
        f"cannot connect to etcd at {where} over TLS: etcd refused the client certificate; "
        f"check that ELASTICJOB_ETCD_CERT={other.cert} is signed by the CA etcd trusts"
    )
    wrong_ca = refusal(endpoint, replace(tls, cacert=other.cacert))
    assert wrong_ca == (
        f"cannot connect to etcd at {where} over TLS: etcd's certificate is not signed by a "
        f"CA in ELASTICJOB_ETCD_CACERT={other.cacert}; check that it is the CA that signed "
        "etcd's certificate"
    )
    plain = refusal(where, None)
    assert plain.startswith(f"etcd at {where}: put /elasticjob/intruder failed (")
    assert "if etcd serves TLS, use an https:// endpoint" in plain
    for line in (no_cert, another_job, wrong_ca, plain):
        assert "\n" not in line and "PRIVATE KEY" not in line
    # and nothing was written: the job's own client sees no intruder
    client = open_client(parse_endpoints(endpoint), tls, timeout=5)
    try:
        assert client.get("/elasticjob/intruder") is None
    finally:
        client.close()


def test_the_rendezvous_refuses_to_start_without_the_certificate(etcd_mtls: EtcdServer) -> None:
    tls = tls_of(etcd_mtls)
    params = RendezvousParameters(
        backend="etcd-v3",
        endpoint=etcd_mtls.endpoint,
        run_id="no-cert",
        min_nodes=1,
        max_nodes=1,
        cacert=tls.cacert,
    )
    with pytest.raises(RendezvousConnectionError, match="none was given"):
        handler_from_params(params)
    with pytest.raises(EtcdTLSError, match="etcd asks for a client certificate"):
        connect(etcd_mtls.endpoint, {"cacert": str(tls.cacert)}, env={}).check()


def test_the_launcher_stops_at_once_on_a_tls_mistake_instead_of_waiting_for_etcd(
    etcd_mtls: EtcdServer, tmp_path: Path
) -> None:
    """In a pod the launcher waits up to 120 s for a starting etcd; a refused certificate
    will not get better, so it says so and exits 2 at once."""
    tls = tls_of(etcd_mtls)
    env = {
        **os.environ,
        contract.POD_NAME: "train-worker-0",  # in a pod: would wait for a starting etcd
        contract.ETCD_CACERT: str(tls.cacert),
        contract.ETCD_CERT: "",
        contract.ETCD_KEY: "",
    }
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "elasticjob_runtime.launch.launcher",
            "--nnodes=1",
            f"--rdzv-endpoint={etcd_mtls.endpoint}",
            "--rdzv-id=refused",
            "--no-warm-spares",
            __file__,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 2, done.stderr
    assert time.monotonic() - started < 60
    where = etcd_mtls.endpoint.removeprefix("https://")
    assert (
        f"elasticjob-run: error: cannot connect to etcd at {where} over TLS: etcd asks for a "
        "client certificate and none was given" in done.stderr
    )


def worker() -> None:
    import torch
    import torch.distributed as dist

    from elasticjob_runtime.etcd.progress import reporter_from_env

    out = Path(os.environ["RDZV_TEST_OUT"])
    dist.init_process_group("gloo")  # the round's store is the etcd, over TLS
    total = torch.ones(1)
    dist.all_reduce(total)
    reporter = reporter_from_env(min_interval=0)
    if reporter is not None:
        reporter.update(STEP, samples=int(total.item()))
    while not (out / "stop").exists():
        time.sleep(0.2)
    if reporter is not None:
        reporter.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker()
