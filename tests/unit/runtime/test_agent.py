"""The agent's pure rules: fault attribution (a signal is a local fault, an exception may be
a peer's) and when the exit barrier stops waiting."""

from __future__ import annotations

from elasticjob_runtime.agent import gone_from_exit_barrier, local_fault


def test_a_worker_killed_by_a_signal_is_a_local_fault_an_exception_may_be_a_peers() -> None:
    assert local_fault([-9])  # SIGKILL / OOM killer
    assert local_fault([1, -11])  # one segfaulted
    assert not local_fault([1])  # e.g. gloo: "Connection closed by peer"


def test_the_exit_barrier_stops_waiting_only_for_peers_whose_lease_is_gone() -> None:
    assert gone_from_exit_barrier([]) is None  # everyone is live: they may still finish
    reason = gone_from_exit_barrier(["10.0.0.3_7_ab", "10.0.0.4_9_cd"])
    assert reason == (
        "10.0.0.3_7_ab, 10.0.0.4_9_cd left the round and will not reach the exit barrier"
    )
