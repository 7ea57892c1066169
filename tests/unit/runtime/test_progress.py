"""Where progress goes (an etcd, never a c10d store), and that it never waits for etcd."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from elasticjob_runtime import contract
from elasticjob_runtime.etcd.endpoints import Endpoint
from elasticjob_runtime.etcd.progress import (
    Nowhere,
    ProgressReporter,
    ProgressTarget,
    memory_fallback_reporter_from_env,
    progress_target,
    reporter_from_env,
)

RUN = {"TORCHELASTIC_RUN_ID": "run-1"}


@pytest.mark.parametrize(
    ("env", "target"),
    [
        (
            {**RUN, "PET_RDZV_BACKEND": "etcd-v3", "PET_RDZV_ENDPOINT": "etcd-a:2379,etcd-b"},
            ProgressTarget((Endpoint("etcd-a", 2379), Endpoint("etcd-b", 2379)), "run-1"),
        ),
        (  # torch's own etcd backends talk to an etcd too
            {**RUN, "PET_RDZV_BACKEND": "etcd", "PET_RDZV_ENDPOINT": "etcd:2379"},
            ProgressTarget((Endpoint("etcd", 2379),), "run-1"),
        ),
        (  # elasticjob-run's word wins: its flags may differ from the environment
            {
                **RUN,
                "PET_RDZV_BACKEND": "c10d",
                "PET_RDZV_ENDPOINT": "worker-0:29400",
                "ELASTICJOB_PROGRESS_ENDPOINT": "job-etcd:2379",
            },
            ProgressTarget((Endpoint("job-etcd", 2379),), "run-1"),
        ),
        (  # the run id from PET_RDZV_ID when torch's agent has not set its own
            {"PET_RDZV_ID": "pet", "ELASTICJOB_PROGRESS_ENDPOINT": "e:1"},
            ProgressTarget((Endpoint("e", 1),), "pet"),
        ),
    ],
)
def test_progress_goes_to_the_runs_etcd(env: dict[str, str], target: ProgressTarget) -> None:
    assert progress_target(env) == target


@pytest.mark.parametrize(
    ("env", "why"),
    [
        (
            {**RUN, "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "worker-0:29400"},
            "the rendezvous (PET_RDZV_BACKEND=c10d) is not an etcd; "
            "set ELASTICJOB_PROGRESS_ENDPOINT to an etcd to publish progress",
        ),
        (
            {**RUN, "PET_RDZV_ENDPOINT": "worker-0:29400"},
            "the rendezvous (PET_RDZV_BACKEND=unset) is not an etcd; "
            "set ELASTICJOB_PROGRESS_ENDPOINT to an etcd to publish progress",
        ),
        ({**RUN, "PET_RDZV_BACKEND": "etcd-v3"}, "no etcd endpoint (PET_RDZV_ENDPOINT is not set)"),
        ({"ELASTICJOB_PROGRESS_ENDPOINT": "e:1"}, "no run id (TORCHELASTIC_RUN_ID or PET_RDZV_ID)"),
        ({**RUN, "ELASTICJOB_PROGRESS_ENDPOINT": "e:1", "ELASTICJOB_PROGRESS": "0"}, "=0"),
    ],
)
def test_no_etcd_means_no_progress_and_says_why(env: dict[str, str], why: str) -> None:
    target = progress_target(env)
    assert isinstance(target, Nowhere) and not target.bad_input
    assert target.why.endswith(why)


def test_a_bad_endpoint_is_named_as_a_mistake() -> None:
    target = progress_target({**RUN, "ELASTICJOB_PROGRESS_ENDPOINT": "etcd:http"})
    assert target == Nowhere(
        "ELASTICJOB_PROGRESS_ENDPOINT: bad etcd endpoint 'etcd:http': the port must be a "
        "number from 1 to 65535",
        bad_input=True,
    )


@pytest.fixture
def silent_listener() -> Iterator[socket.socket]:
    """A port that accepts TCP connections (the kernel completes them) but never answers,
    like a c10d store or a frozen etcd to a gRPC client."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock


def test_under_c10d_nothing_connects_to_the_rendezvous_store(
    silent_listener: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = silent_listener.getsockname()[1]
    for name in (contract.PROGRESS, contract.PROGRESS_ENDPOINT):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(contract.RDZV_BACKEND, "c10d")
    monkeypatch.setenv(contract.RDZV_ENDPOINT, f"127.0.0.1:{port}")
    assert reporter_from_env() is None
    assert memory_fallback_reporter_from_env() is None
    silent_listener.settimeout(1.0)
    with pytest.raises(TimeoutError):
        silent_listener.accept()  # nobody tried


def test_a_reporter_never_waits_for_an_etcd_that_does_not_answer(
    silent_listener: socket.socket,
) -> None:
    etcd = [Endpoint("127.0.0.1", silent_listener.getsockname()[1])]
    started = time.monotonic()
    reporter = ProgressReporter(etcd, "run-1", world_size=2, min_interval=0)
    for step in range(1, 101):
        reporter.update(step, samples=64)
    elapsed = time.monotonic() - started
    reporter.close(wait=0)
    # A request to this port waits out the client's 5 s timeout; the training thread
    # must not see one of them (a blocking grant alone took 5 s).
    assert elapsed < 2.0, f"construction and 100 updates took {elapsed:.1f} s"
    assert reporter.current.step == 100
