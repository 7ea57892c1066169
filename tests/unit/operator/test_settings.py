"""The operator's settings come from the chart's environment, read once at startup; a bad
value stops it with one line naming what to set."""

from __future__ import annotations

import pytest

from elasticjob_operator.etcd.shared import SharedEtcd
from elasticjob_operator.settings import from_env

OFF = {"ELASTICJOB_NETWORK_POLICY": "false"}


def test_defaults() -> None:
    s = from_env(OFF)
    assert s.namespaces == () and s.resync_seconds == 10.0 and s.workers == 8
    assert (s.metrics_port, s.metrics_addr) == (8000, "127.0.0.1")
    assert s.config.below_min_grace_seconds == 300.0 and s.config.shared_etcd is None
    assert s.config.agent_liveness_period_seconds == 10


def test_the_charts_values_are_read() -> None:
    env = {
        **OFF,
        "ELASTICJOB_NAMESPACES": "a,b",
        "ELASTICJOB_RESYNC_SECONDS": "2.5",
        "ELASTICJOB_RECONCILE_WORKERS": "3",
        "ELASTICJOB_NODE_LOST_GRACE_SECONDS": "7",
        "ELASTICJOB_AGENT_LIVENESS_PERIOD_SECONDS": "4",
        "ELASTICJOB_SHARED_ETCD_SERVICE": "etcd",
        "ELASTICJOB_SHARED_ETCD_SECRET": "etcd-tls",
        "ELASTICJOB_OPERATOR_NAMESPACE": "ops",
    }
    s = from_env(env)
    assert s.namespaces == ("a", "b") and s.resync_seconds == 2.5 and s.workers == 3
    assert s.config.node_lost_grace_seconds == 7.0
    assert s.config.agent_liveness_period_seconds == 4
    assert s.config.shared_etcd == SharedEtcd("ops", "etcd", "etcd-tls")


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"ELASTICJOB_RESYNC_SECONDS": "soon"}, "ELASTICJOB_RESYNC_SECONDS='soon' is not a number"),
        ({"ELASTICJOB_RECONCILE_WORKERS": "1"}, "set it to 2 or more"),
        ({"ELASTICJOB_AGENT_LIVENESS_PERIOD_SECONDS": "0"}, "set it to 1 second or more"),
        ({"ELASTICJOB_SHARED_ETCD_SERVICE": "etcd"}, "ELASTICJOB_SHARED_ETCD_SECRET"),
    ],
)
def test_a_bad_value_stops_the_operator_with_one_line(env: dict[str, str], says: str) -> None:
    with pytest.raises(SystemExit, match=says):
        from_env({**OFF, **env})
