"""Kubelet's pod lifecycle decisions: what to start, phases, restarts and back-off."""

from __future__ import annotations

from elasticjob_devcluster.pod_status import (
    BACKOFF_CAP_S,
    ContainerRun,
    backoff_delay,
    duration,
    plan,
    pod_status,
)


def spec(policy: str = "Always", inits: int = 0, containers: int = 1) -> dict:
    return {
        "restartPolicy": policy,
        "initContainers": [{"name": f"init{i}", "image": "x"} for i in range(inits)],
        "containers": [{"name": f"c{i}", "image": "img:1"} for i in range(containers)],
    }


def ran(name: str, code: int, t: float = 100.0) -> ContainerRun:
    run = ContainerRun(name)
    run.started(pid=1, container_id=f"id-{name}", now=t - 1)
    run.exited(code, None, t)
    return run


def test_init_containers_start_one_at_a_time_in_order_before_the_others() -> None:
    s = spec(inits=2, containers=2)
    assert plan(s, {}, 0).start == ["init0"]
    running = ContainerRun("init0")
    running.started(1, "x", 0)
    assert plan(s, {"init0": running}, 1).start == []
    p = plan(s, {"init0": ran("init0", 0)}, 200)
    assert p.start == ["init1"] and p.phase == "Pending"
    p = plan(s, {"init0": ran("init0", 0), "init1": ran("init1", 0)}, 200)
    assert p.start == ["c0", "c1"] and p.init_done


def test_failed_init_container_fails_the_pod_under_never_and_is_retried_otherwise() -> None:
    assert plan(spec("Never", inits=1), {"init0": ran("init0", 1)}, 200).phase == "Failed"
    p = plan(spec("Always", inits=1), {"init0": ran("init0", 1)}, 200)
    assert p.start == ["init0"] and p.phase == "Pending"


def test_exit_zero_succeeds_and_nonzero_fails_under_never() -> None:
    assert plan(spec("Never"), {"c0": ran("c0", 0)}, 200).phase == "Succeeded"
    assert plan(spec("Never"), {"c0": ran("c0", 3)}, 200).phase == "Failed"
    assert plan(spec("OnFailure"), {"c0": ran("c0", 0)}, 200).phase == "Succeeded"


def test_on_failure_restarts_failed_container_after_backoff() -> None:
    run = ran("c0", 1, t=100)
    run.started(2, "y", 100)  # second run: restartCount 1
    run.exited(1, None, 101)
    assert run.restart_count == 1
    p = plan(spec("OnFailure"), {"c0": run}, 101.5)
    assert p.start == [] and p.phase == "Running" and p.wake_at == 101 + backoff_delay(1)
    assert plan(spec("OnFailure"), {"c0": run}, 101 + backoff_delay(1)).start == ["c0"]


def test_always_restarts_even_a_successful_container() -> None:
    p = plan(spec("Always"), {"c0": ran("c0", 0)}, 200)
    assert p.start == ["c0"] and p.phase == "Running"


def test_backoff_starts_immediately_then_doubles_to_a_cap() -> None:
    delays = [backoff_delay(n) for n in range(8)]
    assert delays[0] == 0 and delays[1] < delays[2] < delays[3]
    assert max(delays) == BACKOFF_CAP_S


def test_status_reports_exit_code_reason_and_last_state() -> None:
    s = spec("Never")
    run = ran("c0", 3)
    st = pod_status(
        s,
        {"c0": run},
        phase="Failed",
        pod_ip="10.244.1.2",
        host_ip="127.0.0.1",
        start_time=90,
        sandbox_ready=False,
        prev_conditions=[],
        now=100,
    )
    cs = st["containerStatuses"][0]
    assert st["phase"] == "Failed" and st["podIP"] == "10.244.1.2"
    assert cs["state"]["terminated"]["exitCode"] == 3
    assert cs["state"]["terminated"]["reason"] == "Error"
    assert cs["restartCount"] == 0 and cs["ready"] is False and cs["image"] == "img:1"
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "PodCompleted"


def test_running_container_is_ready_and_a_crashlooping_one_waits_with_last_state() -> None:
    s = spec("Always", containers=2)
    up = ContainerRun("c0")
    up.started(5, "a", 10)
    up.ready = True
    down = ran("c1", 2, t=20)
    down.started(6, "b", 21)
    down.exited(2, None, 22)
    st = pod_status(
        s,
        {"c0": up, "c1": down},
        phase="Running",
        pod_ip="10.244.1.3",
        host_ip="127.0.0.1",
        start_time=9,
        sandbox_ready=True,
        prev_conditions=[],
        now=23,
    )
    c0, c1 = st["containerStatuses"]
    assert c0["state"]["running"] and c0["ready"]
    assert c1["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert c1["state"]["waiting"]["message"] == "back-off 1s restarting failed container=c1"
    assert c1["lastState"]["terminated"]["exitCode"] == 2 and c1["restartCount"] == 1
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and "c1" in ready["message"]


def test_killed_container_reports_signal_exit_code() -> None:
    run = ContainerRun("c0")
    run.started(1, "x", 0)
    run.exited(0, 9, 1)
    assert run.last is not None and run.last.exit_code == 137 and run.last.reason == "Error"


def test_condition_transition_time_is_kept_while_status_is_unchanged() -> None:
    s = spec("Never")
    kwargs = dict(pod_ip="", host_ip="127.0.0.1", start_time=0, sandbox_ready=True)
    first = pod_status(s, {}, phase="Pending", prev_conditions=[], now=1000, **kwargs)  # type: ignore[arg-type]
    again = pod_status(
        s, {}, phase="Pending", prev_conditions=first["conditions"], now=5000, **kwargs
    )  # type: ignore[arg-type]
    assert first["conditions"] == again["conditions"]


def _running_status(s: dict, prev: list[dict]) -> dict:
    run = ContainerRun("c0")
    run.started(5, "a", 10)
    run.ready = True
    return pod_status(
        s,
        {"c0": run},
        phase="Running",
        pod_ip="10.244.1.3",
        host_ip="127.0.0.1",
        start_time=9,
        sandbox_ready=True,
        prev_conditions=prev,
        now=20,
    )


def test_conditions_owned_by_others_are_kept() -> None:
    foreign = {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}
    st = _running_status(spec(), [foreign])
    assert foreign in st["conditions"]


def test_readiness_gate_holds_ready_until_its_condition_is_true() -> None:
    s = {**spec(), "readinessGates": [{"conditionType": "example.com/warm"}]}
    st = _running_status(s, [])
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "ReadinessGatesNotReady"
    gate = {"type": "example.com/warm", "status": "True"}
    st = _running_status(s, [gate])
    assert next(c for c in st["conditions"] if c["type"] == "Ready")["status"] == "True"


def test_a_command_that_cannot_start_is_a_start_error() -> None:
    run = ContainerRun("c0")
    run.started(1, "x", 0)
    run.exited(128, None, 1, start_error="cannot start container: no such file")
    assert run.last is not None and run.last.reason == "StartError"
    st = _running_status({**spec("Never")}, [])  # shape check of a healthy one still passes
    assert st["phase"] == "Running"


def test_a_delay_reads_as_kubelet_prints_it() -> None:
    assert [duration(s) for s in (0, 4, 10.2, 80, 300)] == ["0s", "4s", "10s", "1m20s", "5m0s"]
