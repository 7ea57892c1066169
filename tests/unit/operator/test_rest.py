"""The operator's plain-JSON calls: their URL paths, and that none can hang."""

from __future__ import annotations

import socket
import threading

from kubernetes.client import ApiClient, Configuration

from elasticjob_operator.rest import CONNECT_TIMEOUT_S, READ_TIMEOUT_S, Rest, path


def test_core_objects_live_under_api_v1_and_the_others_under_apis() -> None:
    assert path("v1", "ml", "pods") == "/api/v1/namespaces/ml/pods"
    assert path("v1", "ml", "pods", "train-worker-0") == "/api/v1/namespaces/ml/pods/train-worker-0"
    assert path("apps/v1", "ml", "deployments", "train-etcd") == (
        "/apis/apps/v1/namespaces/ml/deployments/train-etcd"
    )
    assert path("elastic.pytorch.org/v1alpha1", "ml", "elasticjobs") == (
        "/apis/elastic.pytorch.org/v1alpha1/namespaces/ml/elasticjobs"
    )


def _request_in_thread(rest: Rest, url_path: str) -> tuple[threading.Thread, list[object]]:
    outcome: list[object] = []

    def call() -> None:
        try:
            outcome.append(rest.get(url_path))
        except Exception as exc:  # what the caller's retry loop sees
            outcome.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread, outcome


def _api(port: int) -> ApiClient:
    config = Configuration(host=f"http://127.0.0.1:{port}")
    config.retries = 0
    return ApiClient(config)


def test_a_call_whose_connection_is_never_accepted_fails_instead_of_hanging() -> None:
    # A full accept queue makes Linux drop the next SYN: the client sits in SYN_SENT as
    # behind a lost Service address, for the kernel's ~2 minutes without a connect timeout.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):  # fills the queue
            thread, outcome = _request_in_thread(Rest(_api(port), timeouts=(1.0, 1.0)), "/x")
            thread.join(30)
    assert not thread.is_alive(), "the call still waits for its connection after 30 s"
    assert isinstance(outcome[0], Exception), outcome


def test_a_call_that_gets_no_answer_fails_instead_of_hanging() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        thread, outcome = _request_in_thread(Rest(_api(port), timeouts=(1.0, 1.0)), "/x")
        conn, _ = server.accept()  # accepted, read, never answered
        with conn:
            thread.join(30)
            assert not thread.is_alive(), "the call still waits for an answer after 30 s"
    assert isinstance(outcome[0], Exception), outcome


def test_every_call_is_bounded_by_default() -> None:
    assert Rest(ApiClient(Configuration())).timeouts == (CONNECT_TIMEOUT_S, READ_TIMEOUT_S)
