"""The thin layer around the decisions: the status write is an RFC 7386 merge patch (only
what changed is sent, a field the new status lost becomes null), and the operator's own
status write does not trigger another round."""

from __future__ import annotations

from typing import Any

import pytest

from elasticjob_operator.kube import merge_patch


def test_unchanged_status_sends_nothing() -> None:
    status = {"phase": "Running", "replicaStatuses": {"Worker": {"active": 2}}}
    assert merge_patch(status, dict(status)) == {}


def test_changed_nested_value_is_sent_alone() -> None:
    old = {"phase": "Running", "replicaStatuses": {"Worker": {"active": 2, "failed": 0}}}
    new = {"phase": "Running", "replicaStatuses": {"Worker": {"active": 1, "failed": 0}}}
    assert merge_patch(old, new) == {"replicaStatuses": {"Worker": {"active": 1}}}


def test_removed_fields_become_null_and_lists_are_replaced() -> None:
    old = {"belowMinSince": "2026-01-01T00:00:00Z", "conditions": [{"type": "A"}]}
    new = {"conditions": [{"type": "A"}, {"type": "B"}]}
    assert merge_patch(old, new) == {
        "belowMinSince": None,
        "conditions": [{"type": "A"}, {"type": "B"}],
    }


def test_the_operators_own_status_write_does_not_trigger_another_round() -> None:
    from elasticjob_operator.handlers import is_own_status_echo

    acted = {"metadata": {"generation": 3}, "status": {"observedGeneration": 3}}
    assert is_own_status_echo("MODIFIED", acted)
    scaled = {"metadata": {"generation": 4}, "status": {"observedGeneration": 3}}
    assert not is_own_status_echo("MODIFIED", scaled)  # kubectl scale bumps generation
    assert not is_own_status_echo(None, acted)  # the initial listing always reconciles
    assert not is_own_status_echo("ADDED", {"metadata": {"generation": 1}})


def test_a_round_stopped_by_an_error_says_what_it_had_done_first() -> None:
    """The deletes run before the creates. When one of them fails for good, the events of
    the children already deleted or created are still posted: the next round finds
    those pods gone and would never say so (an e2e run once missed its ForceDeletedPod)."""
    from elasticjob_operator.decision import ChildRef, Decision, reported
    from elasticjob_operator.kube import Carried, Conflict, carry_out
    from elasticjob_operator.models import ElasticJobStatus

    d = Decision(status=ElasticJobStatus())
    d.delete += [ChildRef("Pod", "w-0", force=True), ChildRef("Pod", "w-1")]
    d.create.append({"kind": "Pod", "metadata": {"name": "w-2"}})
    d.normal("ForceDeletedPod", "force-deleted w-0", reports_deleted=("Pod/w-0",))
    d.normal("ScaledDown", "deleted w-1", reports_deleted=("Pod/w-1",))
    d.normal("CreatedWorkers", "created w-2", reports=("Pod/w-2",))
    seen: list[Carried] = []

    def fail_on(name: str) -> Any:
        def act(child: Any) -> None:
            got = child.name if isinstance(child, ChildRef) else child["metadata"]["name"]
            if got == name:
                raise TimeoutError(f"the API server did not answer about {got}")

        return act

    for failing, said in (
        ("w-2", ["ForceDeletedPod", "ScaledDown"]),  # a create failed
        ("w-1", ["ForceDeletedPod"]),  # the second delete failed
    ):
        seen.clear()
        with pytest.raises(TimeoutError):
            carry_out(d, fail_on(failing), fail_on(failing), seen.append)
        (done,) = seen
        assert [e.reason for e in reported(d.events, done.created, done.deleted)] == said

    def taken(obj: Any) -> None:
        raise Conflict("Pod w-2 already exists")

    done = carry_out(d, fail_on(""), taken, seen.append)  # a name taken stops nothing
    assert done.deleted == {"Pod/w-0", "Pod/w-1"} and isinstance(done.conflict, Conflict)
