"""The agent's pure rules: fault attribution (a signal is a local fault, an exception may be
a peer's), when the exit barrier stops waiting, and when a monitor pass reads the steps."""

from __future__ import annotations

from elasticjob_runtime.launch.agent import (
    STEP_READ_INTERVAL_S,
    gone_from_exit_barrier,
    local_fault,
    steps_due,
)


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


def test_a_monitor_pass_reads_the_steps_once_per_interval_and_only_for_a_reader() -> None:
    assert steps_due(-1.0, 0.0, wanted=True)  # the first pass reads
    assert not steps_due(10.0, 10.0 + STEP_READ_INTERVAL_S - 0.1, wanted=True)
    assert steps_due(10.0, 10.0 + STEP_READ_INTERVAL_S, wanted=True)
    # no hang timeout and no spares waiting for a refill: nobody reads the files
    assert not steps_due(-1.0, 100.0, wanted=False)
