"""procs.replaced: a restarted process takes its predecessor's place in the records."""

from __future__ import annotations

import pytest

from elasticjob_devcluster.procs import ProcessRecord, replaced

ETCD = ProcessRecord("etcd", 10, 100)
API = ProcessRecord("kube-apiserver", 11, 101)
CM = ProcessRecord("kube-controller-manager", 12, 102)


def test_the_new_record_takes_the_old_ones_place() -> None:
    new = ProcessRecord("kube-apiserver", 50, 500)
    assert replaced([ETCD, API, CM], API, new) == [ETCD, new, CM]


def test_a_record_that_is_not_there_is_an_error_naming_it() -> None:
    stale = ProcessRecord("kube-apiserver", 11, 999)  # same pid, another start: not ours
    with pytest.raises(ValueError, match=r"kube-apiserver \(pid 11\) is not among"):
        replaced([ETCD, API, CM], stale, ProcessRecord("kube-apiserver", 50, 500))
