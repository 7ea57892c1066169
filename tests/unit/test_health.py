"""The probe endpoints: /healthz and /readyz, on the pod IP and the contract's port."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from elasticjob_runtime.health import HealthServer


def test_health_endpoints_report_live_then_ready() -> None:
    def get(url: str) -> int:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as err:
            return err.code

    with HealthServer("127.0.0.1", 0) as server:
        assert server.host == "127.0.0.1"
        assert get(f"{server.url}/healthz") == 200
        assert get(f"{server.url}/readyz") == 503
        server.mark_ready()
        assert get(f"{server.url}/readyz") == 200
        assert get(f"{server.url}/checkpoint/latest") == 404  # no checkpoint over HTTP
        assert get(f"{server.url}/nope") == 404


def test_health_address_defaults_to_loopback_and_contract_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from elasticjob_runtime.health import health_address_from_env

    monkeypatch.delenv("ELASTICJOB_POD_IP", raising=False)
    monkeypatch.delenv("ELASTICJOB_HEALTH_PORT", raising=False)
    assert health_address_from_env() == ("127.0.0.1", 8090)
    monkeypatch.setenv("ELASTICJOB_POD_IP", "10.1.2.3")
    monkeypatch.setenv("ELASTICJOB_HEALTH_PORT", "x")
    with pytest.raises(ValueError, match="ELASTICJOB_HEALTH_PORT='x' is not a port number"):
        health_address_from_env()
    monkeypatch.setenv("ELASTICJOB_HEALTH_PORT", "9000")
    assert health_address_from_env() == ("10.1.2.3", 9000)


def test_serve_from_env_listens_on_loopback_and_uses_the_ready_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from elasticjob_runtime.health import serve_from_env

    monkeypatch.delenv("ELASTICJOB_POD_IP", raising=False)
    monkeypatch.setenv("ELASTICJOB_HEALTH_PORT", "0")
    started = {"yes": False}
    server = serve_from_env(ready=lambda: started["yes"], live=lambda: True)
    try:
        assert server.host == "127.0.0.1"

        def status(path: str) -> int:
            try:
                with urllib.request.urlopen(server.url + path, timeout=10) as resp:
                    return int(resp.status)
            except urllib.error.HTTPError as err:
                return err.code

        assert (status("/healthz"), status("/readyz")) == (200, 503)
        started["yes"] = True
        assert status("/readyz") == 200
    finally:
        server.stop()
