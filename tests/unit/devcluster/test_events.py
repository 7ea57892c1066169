"""Events about pods look as kubelet's do (what `kubectl describe pod` lists)."""

from __future__ import annotations

from elasticjob_devcluster.events import SCHEDULER, event_body


def test_an_event_names_the_pod_the_reporter_and_the_node() -> None:
    pod = {"metadata": {"name": "w-0", "namespace": "ns", "uid": "u1"}}
    ev = event_body(pod, "node-1", "Warning", "BackOff", "restarting", SCHEDULER, 0.0)
    assert ev["metadata"] == {"generateName": "w-0.", "namespace": "ns"}
    assert ev["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "w-0",
        "namespace": "ns",
        "uid": "u1",
    }
    assert (ev["type"], ev["reason"], ev["message"]) == ("Warning", "BackOff", "restarting")
    assert ev["source"] == {"component": "default-scheduler", "host": "node-1"}
    assert ev["firstTimestamp"] == ev["lastTimestamp"] == "1970-01-01T00:00:00Z"
