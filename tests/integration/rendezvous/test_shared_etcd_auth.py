"""The shared etcd (the chart's ``sharedEtcd.enabled``) as the operator runs it: a real
etcd 3.6 with client-certificate auth and the certificates the operator issues; the
operator switches authentication on and adds each job's user; a job's certificate opens
its own keys only, real agents rendezvous and publish progress through it, the operator
reads that progress as root, and a job's user goes with the job.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from conftest import EtcdServer, read_progress, start, start_etcd, wait_for

from elasticjob_operator import observe
from elasticjob_operator.etcd import certs as etcd_certs
from elasticjob_operator.etcd import reader as etcd_reader
from elasticjob_operator.etcd import shared as shared_etcd
from elasticjob_operator.etcd.leaving import mark_leaving
from elasticjob_operator.etcd.users import EtcdUsers, SharedEtcdNotReady
from elasticjob_runtime import contract
from elasticjob_runtime.etcd.client import EtcdClient, EtcdError
from elasticjob_runtime.etcd.endpoints import TLSCredentials, parse_endpoints
from elasticjob_runtime.etcd.records import Member, encode_member
from elasticjob_runtime.etcd.tls import EtcdTLS, credentials, open_client, tls_environ

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

NOW = datetime.now(UTC)
PASSWORD = "root-password-for-the-test"
ISSUED = etcd_certs.issue_shared("ops", "rel-etcd", NOW)
WORKER_SCRIPT = Path(__file__).with_name("test_etcd_mtls.py")  # publishes progress, step 7


def _shared_certificates(where: Path) -> tuple[list[str], EtcdTLS | None]:
    where.mkdir(parents=True, exist_ok=True)
    for name in ("ca_cert", "server_cert", "server_key", "client_cert", "client_key"):
        (where / f"{name}.pem").write_bytes(getattr(ISSUED, name))
    flags = [
        "--client-cert-auth",
        f"--trusted-ca-file={where / 'ca_cert.pem'}",
        f"--cert-file={where / 'server_cert.pem'}",
        f"--key-file={where / 'server_key.pem'}",
    ]
    operator = EtcdTLS(
        str(where / "ca_cert.pem"), str(where / "client_cert.pem"), str(where / "client_key.pem")
    )
    return flags, operator


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[EtcdServer]:
    server = start_etcd("3.6", tmp_path / "etcd", certificates=_shared_certificates)
    yield server
    server.stop()


def _operator_tls() -> TLSCredentials:
    return TLSCredentials(ca=ISSUED.ca_cert, cert=ISSUED.client_cert, key=ISSUED.client_key)


def _users(server: EtcdServer) -> EtcdUsers:
    return EtcdUsers(server.endpoint, _operator_tls(), PASSWORD, secret="ops/rel-etcd-tls")


def _job_files(uid: str, where: Path) -> EtcdTLS:
    """What the job's client Secret mounts into its workers: the shared CA, its cert."""
    cert = etcd_certs.issue_client(
        "train", "ml", "train-worker", ISSUED.ca_cert, ISSUED.ca_key, NOW, shared_etcd.user_of(uid)
    )
    where.mkdir(parents=True, exist_ok=True)
    (where / "ca.crt").write_bytes(ISSUED.ca_cert)
    (where / "tls.crt").write_bytes(cert.cert)
    (where / "tls.key").write_bytes(cert.key)
    return EtcdTLS(str(where / "ca.crt"), str(where / "tls.crt"), str(where / "tls.key"))


def _client(server: EtcdServer, files: EtcdTLS) -> EtcdClient:
    return open_client(parse_endpoints(server.endpoint), files, timeout=5)


def test_each_job_reaches_its_own_keys_only(shared: EtcdServer, tmp_path: Path) -> None:
    users = _users(shared)
    assert users.ensure_auth() is True  # a new etcd: switched on
    assert users.ensure_auth() is False
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    users.add_job(a)
    users.add_job(b)
    _users(shared).add_job(a)  # a restarted operator adds it again: no error
    client_a = _client(shared, _job_files(a, tmp_path / "a"))
    client_b = _client(shared, _job_files(b, tmp_path / "b"))
    try:
        # every operation the rendezvous uses, on its own run's keys (and a later run's)
        for run in (a, f"{a}-1"):
            prefix = contract.run_prefix(run)
            lease = client_a.grant(5)
            client_a.put(prefix + "member", b"x", lease=lease)
            assert client_a.compare_and_set(prefix + "state", b"1", None)[0]
            assert client_a.get(prefix + "member") is not None
            assert client_a.snapshot(prefix).items
            assert client_a.refresh(lease)
            client_a.revoke(lease)
            client_a.delete_prefix(prefix)
        client_a.put(contract.progress_key(a), b"mine")
        # another job's keys, and keys of no job: refused, saying so
        for key in (contract.progress_key(b), "/elasticjob/other", "/registry/x"):
            with pytest.raises(EtcdError, match="permission denied"):
                client_a.get(key)
            with pytest.raises(EtcdError, match="permission denied"):
                client_a.put(key, b"theirs")
        with pytest.raises(EtcdError, match="permission denied"):
            client_b.snapshot(contract.run_prefix(a))
    finally:
        client_a.close()
        client_b.close()


def test_a_run_rendezvouses_through_it_and_the_operator_reads_its_progress(
    shared: EtcdServer, agents: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    users = _users(shared)
    users.ensure_auth()
    uid = str(uuid.uuid4())
    users.add_job(uid)
    files = _job_files(uid, tmp_path / "job")
    log = tmp_path / "agent.log"
    env = {**tls_environ(files), "RDZV_TEST_OUT": str(tmp_path)}
    agent = start(agents, shared, log, [str(WORKER_SCRIPT)], nproc=2, env=env, run_id=uid)
    client = _client(shared, files)
    try:
        wait_for(
            "progress published through the shared etcd",
            lambda: p if (p := read_progress(client, uid)) and p.step == 7 else None,
            120,
            log,
        )
        # the operator: as root, by token (the gateway takes no user from a certificate)
        records = etcd_reader.read_run_records(
            shared.endpoint, uid, tls=_operator_tls(), token=users.token()
        )
        seen = observe.progress_of(records.progress)
        assert seen is not None and seen.step == 7 and seen.world_size == 2
        # with the job's certificate only, the gateway reads nothing (and does not fail)
        alone = etcd_reader.read_run_records(shared.endpoint, uid, tls=credentials(files))
        assert alone.progress is None
        (tmp_path / "stop").touch()
        assert agent.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        client.close()


def test_the_operator_marks_a_jobs_leaving_nodes_as_root_on_their_own_leases(
    shared: EtcdServer, tmp_path: Path
) -> None:
    """A scale-down's leaving marks (etcd/leaving.py) go through the shared etcd's auth as
    the operator's reads do: root's token over the gateway; the job's role is unchanged."""
    users = _users(shared)
    users.ensure_auth()
    uid = str(uuid.uuid4())
    users.add_job(uid)
    client = _client(shared, _job_files(uid, tmp_path / "job"))
    try:
        # two agents of the job, as their lease holders register them
        leases = {addr: client.grant(30) for addr in ("10.0.0.1", "10.0.0.2")}
        for addr, lease in leases.items():
            member = encode_member(Member(addr=addr, pid=7))
            client.put(contract.members_prefix(uid) + f"{addr}_7_x", member, lease=lease)
        marked = mark_leaving(
            shared.endpoint, uid, {"10.0.0.2"}, tls=_operator_tls(), token=users.token()
        )
        assert marked == ["10.0.0.2_7_x"]
        mark = client.get(contract.leaving_prefix(uid) + "10.0.0.2_7_x")
        assert mark is not None and mark.lease == leases["10.0.0.2"]  # goes with the node
        assert not client.get(contract.leaving_prefix(uid) + "10.0.0.1_7_x")
        # with the job's certificate only, the gateway writes nothing (and does not fail)
        assert mark_leaving(shared.endpoint, uid, {"10.0.0.1"}, tls=_operator_tls()) == []
        client.revoke(leases["10.0.0.2"])
        assert client.get(contract.leaving_prefix(uid) + "10.0.0.2_7_x") is None
    finally:
        client.close()


def test_a_deleted_jobs_user_and_keys_go_and_a_missed_one_is_swept(
    shared: EtcdServer, tmp_path: Path
) -> None:
    users = _users(shared)
    users.ensure_auth()
    gone, missed, live = (str(uuid.uuid4()) for _ in range(3))
    for uid in (gone, missed, live):
        users.add_job(uid)
    client = _client(shared, _job_files(gone, tmp_path / "gone"))
    try:
        client.put(contract.progress_key(gone), b"old")
        users.remove_job(gone)
        users.remove_job(gone)  # twice: no error
        with pytest.raises(EtcdError):
            client.get(contract.progress_key(gone))
    finally:
        client.close()
    # its keys went too: a new job of that uid (impossible, but its prefix) starts empty
    root = etcd_reader.read_run_records(
        shared.endpoint, gone, tls=_operator_tls(), token=users.token()
    )
    assert root.progress is None
    # the job whose DELETED event the operator missed: swept by the resync
    known = users.users()
    assert shared_etcd.user_of(missed) in known and shared_etcd.user_of(gone) not in known
    assert users.remove_stale(known, {live}) == [shared_etcd.user_of(missed)]
    assert set(users.users()) == {"root", shared_etcd.user_of(live)}


def test_an_emptied_etcd_gets_its_auth_and_users_back(shared: EtcdServer, tmp_path: Path) -> None:
    """Its pod replaced (an emptyDir): authentication off, no users; the next resync
    switches it on again and each job's next round adds its user."""
    users = _users(shared)
    users.ensure_auth()
    uid = str(uuid.uuid4())
    users.add_job(uid)
    shared.stop()
    shutil.rmtree(Path(shared.log).parent / "data")
    shared.restart()
    assert users.ensure_auth() is True
    users.add_job(uid)  # forgotten by ensure_auth, so added again
    client = _client(shared, _job_files(uid, tmp_path / "job"))
    try:
        client.put(contract.progress_key(uid), b"again")
        with pytest.raises(EtcdError, match="permission denied"):
            client.get(contract.progress_key(str(uuid.uuid4())))
    finally:
        client.close()


def test_a_wrong_root_password_is_one_line_naming_the_secret(shared: EtcdServer) -> None:
    _users(shared).ensure_auth()
    wrong = EtcdUsers(shared.endpoint, _operator_tls(), "not-it", secret="ops/rel-etcd-tls")
    with pytest.raises(SharedEtcdNotReady, match=r"root password.*ops/rel-etcd-tls"):
        wrong.add_job(str(uuid.uuid4()))
