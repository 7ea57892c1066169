"""The agent's fault attribution: a signal is a local fault, an exception may be a peer's."""

from __future__ import annotations

from elasticjob_runtime.agent import local_fault


def test_a_worker_killed_by_a_signal_is_a_local_fault_an_exception_may_be_a_peers() -> None:
    assert local_fault([-9])  # SIGKILL / OOM killer
    assert local_fault([1, -11])  # one segfaulted
    assert not local_fault([1])  # e.g. gloo: "Connection closed by peer"
