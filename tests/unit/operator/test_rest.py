"""URL paths of the operator's plain-JSON calls."""

from __future__ import annotations

from elasticjob_operator.rest import path


def test_core_objects_live_under_api_v1_and_the_others_under_apis() -> None:
    assert path("v1", "ml", "pods") == "/api/v1/namespaces/ml/pods"
    assert path("v1", "ml", "pods", "train-worker-0") == "/api/v1/namespaces/ml/pods/train-worker-0"
    assert path("apps/v1", "ml", "deployments", "train-etcd") == (
        "/apis/apps/v1/namespaces/ml/deployments/train-etcd"
    )
    assert path("elastic.pytorch.org/v1alpha1", "ml", "elasticjobs") == (
        "/apis/elastic.pytorch.org/v1alpha1/namespaces/ml/elasticjobs"
    )
