"""Rule "Stuck workers": which waiting reasons are failures, one Warning per pod and reason,
and what the Running condition adds."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from elasticjob_operator import models
from elasticjob_operator.observe import ObservedPod, Waiting, observe_pod
from elasticjob_operator.pod_start_failures import (
    MAX_MESSAGE,
    MAX_REMEMBERED,
    REASON,
    STUCK,
    TRANSIENT,
    decide_start_failures,
    start_failure,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)
MISSING = 'secret "hf-token" not found'


def pod(
    i: int, *waiting: Waiting, phase: str = "Pending", terminating: bool = False
) -> ObservedPod:
    return ObservedPod(
        f"train-worker-{i}", i, phase, terminating=terminating, waiting=tuple(waiting)
    )


def config_error(message: str = MISSING) -> Waiting:
    return Waiting("trainer", "CreateContainerConfigError", message)


def names(pods: list[ObservedPod]) -> frozenset[str]:
    return frozenset(p.name for p in pods)


def test_a_missing_secret_is_one_warning_naming_the_pod_reason_and_message() -> None:
    pods = [pod(0, config_error()), pod(1, phase="Running")]
    decided = decide_start_failures((), pods, names(pods), NOW)
    [event] = decided.events
    assert (event.type, event.reason) == ("Warning", REASON)
    assert event.message == (
        f"worker pod train-worker-0: CreateContainerConfigError (container trainer): "
        f"{MISSING}; create the Secret or ConfigMap its env names, or fix the template; "
        "the kubelet retries"
    )
    said = f"train-worker-0: CreateContainerConfigError (container trainer): {MISSING}"
    assert decided.summary == said
    assert decided.remembered == (
        models.StuckWorker(
            pod="train-worker-0",
            container="trainer",
            reason="CreateContainerConfigError",
            message=MISSING,
            time=NOW,
        ),
    )


def test_the_same_pod_and_reason_is_warned_once_while_the_pod_exists() -> None:
    pods = [pod(0, config_error())]
    first = decide_start_failures((), pods, names(pods), NOW)
    again = decide_start_failures(first.remembered, pods, names(pods), NOW)
    assert again.events == () and again.remembered == first.remembered
    assert again.summary == first.summary  # the condition still says it
    # an image pull that flips to its back-off and back: still the one warning
    flipping = [pod(0, Waiting("trainer", "ImagePullBackOff", 'Back-off pulling image "x"'))]
    pulled = decide_start_failures((), flipping, names(flipping), NOW)
    retry = [pod(0, Waiting("trainer", "ErrImagePull", "rpc error: not found"))]
    between = decide_start_failures(pulled.remembered, retry, names(retry), NOW)
    assert between.events == () and "ErrImagePull" in between.summary
    back = decide_start_failures(between.remembered, flipping, names(flipping), NOW)
    assert back.events == ()


def test_a_new_reason_for_the_same_pod_is_a_new_warning() -> None:
    pods = [pod(0, config_error())]
    first = decide_start_failures((), pods, names(pods), NOW)
    crashing = [pod(0, Waiting("sidecar", "CrashLoopBackOff", "back-off 10s"), phase="Running")]
    later = decide_start_failures(first.remembered, crashing, names(crashing), NOW)
    assert [e.message.split(":")[0] for e in later.events] == ["worker pod train-worker-0"]
    assert "CrashLoopBackOff (container sidecar)" in later.events[0].message
    assert len(later.remembered) == 2


def test_a_pod_gone_is_forgotten_so_its_replacement_is_warned_again() -> None:
    pods = [pod(0, config_error())]
    first = decide_start_failures((), pods, names(pods), NOW)
    gone = decide_start_failures(first.remembered, [], frozenset(), NOW)
    assert gone.remembered == () and gone.summary == ""
    again = decide_start_failures(gone.remembered, pods, names(pods), NOW)
    assert len(again.events) == 1


def test_a_terminating_pod_is_remembered_but_not_named() -> None:
    stuck = [pod(0, config_error())]
    first = decide_start_failures((), stuck, names(stuck), NOW)
    leaving = pod(0, config_error(), terminating=True)
    decided = decide_start_failures(first.remembered, [leaving], names([leaving]), NOW)
    assert decided.remembered == first.remembered and decided.summary == ""


@pytest.mark.parametrize("reason", sorted(TRANSIENT))
def test_a_transient_reason_is_named_but_not_warned(reason: str) -> None:
    pods = [pod(0, Waiting("trainer", reason, "once"))]
    decided = decide_start_failures((), pods, names(pods), NOW)
    assert decided.events == () and decided.remembered == ()
    assert decided.summary == f"train-worker-0: {reason} (container trainer): once"


@pytest.mark.parametrize("reason", sorted(STUCK))
def test_every_stuck_reason_is_warned(reason: str) -> None:
    pods = [pod(0, Waiting("trainer", reason))]
    [event] = decide_start_failures((), pods, names(pods), NOW).events
    assert f"train-worker-0: {reason} (container trainer); " in event.message


@pytest.mark.parametrize("reason", ["ContainerCreating", "PodInitializing", "SomethingNew"])
def test_a_pod_starting_normally_is_not_a_failure(reason: str) -> None:
    assert start_failure(pod(0, Waiting("trainer", reason))) is None


def test_a_stuck_container_comes_before_a_transient_one_and_ended_pods_say_nothing() -> None:
    both = pod(0, Waiting("init", "ErrImagePull"), Waiting("trainer", "InvalidImageName"))
    failure = start_failure(both)
    assert failure is not None and (failure.container, failure.reason) == (
        "trainer",
        "InvalidImageName",
    )
    for phase in ("Succeeded", "Failed"):
        assert start_failure(pod(0, config_error(), phase=phase)) is None


def test_the_condition_names_three_pods_and_counts_the_rest_in_index_order() -> None:
    pods = [pod(i, config_error()) for i in (11, 2, 0, 1, 3)]
    summary = decide_start_failures((), pods, names(pods), NOW).summary
    named = [part.split(":")[0] for part in summary.split("; ")]
    assert named == ["train-worker-0", "train-worker-1", "train-worker-2", "and 2 more waiting"]


def test_long_messages_are_cut_and_warnings_held_are_bounded() -> None:
    failure = start_failure(pod(0, config_error("x " * 1000)))
    assert failure is not None and len(failure.message) == MAX_MESSAGE
    many = [pod(i, config_error()) for i in range(MAX_REMEMBERED + 5)]
    decided = decide_start_failures((), many, names(many), NOW)
    assert len(decided.events) == len(decided.remembered) == MAX_REMEMBERED
    # a slot freed by a pod that went is taken by one not yet warned about
    rest = many[1:]
    later = decide_start_failures(decided.remembered, rest, names(rest), NOW)
    assert [e.message.split(":")[0] for e in later.events] == [
        f"worker pod train-worker-{MAX_REMEMBERED}"
    ]


def test_observe_reads_each_waiting_container_init_containers_first() -> None:
    raw = {
        "metadata": {
            "name": "train-worker-0",
            "labels": {"elastic.pytorch.org/replica-index": "0"},
        },
        "status": {
            "phase": "Pending",
            "initContainerStatuses": [
                {"name": "fetch", "state": {"waiting": {"reason": "ImagePullBackOff"}}}
            ],
            "containerStatuses": [
                {
                    "name": "trainer",
                    "state": {"waiting": {"reason": "PodInitializing"}},
                },
                {"name": "side", "state": {"running": {}}},
                {"name": "empty", "state": {"waiting": {}}},
            ],
        },
    }
    observed = observe_pod(raw, "uid")
    assert observed is not None
    assert observed.waiting == (
        Waiting("fetch", "ImagePullBackOff", ""),
        Waiting("trainer", "PodInitializing", ""),
    )
