"""The probe endpoints: /healthz and /readyz, on the pod IP and the contract's port."""

from __future__ import annotations

import socket
import struct
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest

from elasticjob_runtime.launch.health import HealthServer, health_address, health_wanted


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return err.code


def test_live_at_once_and_ready_while_the_check_says_so() -> None:
    joined = threading.Event()
    with HealthServer("127.0.0.1", 0, ready=joined.is_set) as server:
        assert server.host == "127.0.0.1"
        assert (status(f"{server.url}/healthz"), status(f"{server.url}/readyz")) == (200, 503)
        joined.set()
        assert status(f"{server.url}/readyz?verbose") == 200
        joined.clear()
        assert status(f"{server.url}/readyz") == 503
        assert status(f"{server.url}/healthz") == 200
        assert status(f"{server.url}/checkpoint/latest") == 404  # probes only, no files


def test_served_in_a_pod_or_where_a_port_is_asked_for() -> None:
    assert not health_wanted({})
    assert health_wanted({"ELASTICJOB_POD_NAME": "job-worker-0"})
    assert health_wanted({"ELASTICJOB_HEALTH_PORT": "0"})
    assert not health_wanted({"ELASTICJOB_POD_NAME": ""})


def test_address_defaults_to_loopback_and_the_contract_port() -> None:
    assert health_address({}) == ("127.0.0.1", 8090)
    env = {"ELASTICJOB_POD_IP": "10.1.2.3", "ELASTICJOB_HEALTH_PORT": "9000"}
    assert health_address(env) == ("10.1.2.3", 9000)
    with pytest.raises(ValueError, match="ELASTICJOB_HEALTH_PORT='x' is not a port number"):
        health_address({"ELASTICJOB_HEALTH_PORT": "x"})
    with pytest.raises(ValueError, match=r"ELASTICJOB_HEALTH_PORT=70000 is outside 0\.\.65535"):
        health_address({"ELASTICJOB_HEALTH_PORT": "70000"})


def probe_and_reset(server: HealthServer, path: str) -> None:
    """A client that sends its request and hangs up with a reset before the reply."""
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())


def test_a_client_that_hangs_up_is_not_an_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    asked, gone, handled = threading.Event(), threading.Event(), threading.Event()

    def ready() -> bool:
        asked.set()
        gone.wait(10)  # reply only once the client has reset the connection
        return True

    with HealthServer("127.0.0.1", 0, ready=ready) as server:
        served = server._server
        close = served.shutdown_request

        def closed(request: Any) -> None:  # the last thing done with a request
            close(request)
            handled.set()

        monkeypatch.setattr(served, "shutdown_request", closed)
        probe_and_reset(server, "/readyz")
        assert asked.wait(10)
        gone.set()
        assert handled.wait(10)
    assert capsys.readouterr().err == ""


def test_other_errors_are_still_printed(capsys: pytest.CaptureFixture[str]) -> None:
    def broken() -> bool:
        raise RuntimeError("readiness check broke")

    with (
        HealthServer("127.0.0.1", 0, ready=broken) as server,
        pytest.raises((urllib.error.URLError, ConnectionError)),
    ):
        status(f"{server.url}/readyz")
    assert "RuntimeError: readiness check broke" in capsys.readouterr().err
