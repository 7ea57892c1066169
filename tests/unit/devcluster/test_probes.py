"""Probe decisions: ports by name, thresholds for startup, readiness and liveness."""

from __future__ import annotations

import pytest

from elasticjob_devcluster.probes import (
    ProbeState,
    liveness_failed,
    probe_port,
    readiness_after,
    startup_verdict,
)


def states(*results: bool) -> ProbeState:
    st = ProbeState(next_at=0.0)
    for ok in results:
        st.record(ok)
    return st


def test_a_probe_port_is_a_number_or_the_name_of_a_container_port() -> None:
    container = {"ports": [{"name": "http", "containerPort": 8080}]}
    assert probe_port(container, 9) == 9
    assert probe_port(container, "9") == 9
    assert probe_port(container, "http") == 8080
    with pytest.raises(ValueError, match="no container port named 'grpc'"):
        probe_port(container, "grpc")


def test_successes_and_failures_count_in_a_row() -> None:
    st = states(True, True, False)
    assert (st.successes, st.failures) == (0, 1)
    st.record(True)
    assert (st.successes, st.failures) == (1, 0)


def test_readiness_flips_only_at_its_thresholds() -> None:
    probe = {"successThreshold": 2, "failureThreshold": 2}
    assert readiness_after(states(True), probe, False) is False
    assert readiness_after(states(True, True), probe, False) is True
    assert readiness_after(states(True, True, False), probe, True) is True
    assert readiness_after(states(False, False), probe, True) is False
    # kubelet's defaults: one success, three failures
    assert readiness_after(states(True), {}, False) is True
    assert readiness_after(states(False, False), {}, True) is True
    assert readiness_after(states(False, False, False), {}, True) is False


def test_liveness_fails_at_the_failure_threshold() -> None:
    assert not liveness_failed(states(False, False), {})
    assert liveness_failed(states(False, False, False), {})
    assert liveness_failed(states(False), {"failureThreshold": 1})
    assert not liveness_failed(states(False, True), {"failureThreshold": 1})


def test_a_startup_probe_passes_at_its_first_success_and_fails_at_its_threshold() -> None:
    probe = {"failureThreshold": 3}
    assert startup_verdict(states(False, False), probe) is None
    assert startup_verdict(states(False, False, True), probe) is True
    assert startup_verdict(states(False, False, False), probe) is False
    assert startup_verdict(states(True), {"successThreshold": 5}) is True  # kubelet takes 1
