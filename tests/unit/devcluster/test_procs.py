"""procs.replaced: a restarted process takes its predecessor's place in the records;
procs.stop ends its wait as soon as the caller says the process is done."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from elasticjob_devcluster import procs
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


# Takes SIGTERM as a server that stops listening but drains its streams would: it says
# so (a file) and keeps running.
DRAINS = """
import pathlib, signal, sys, time
said = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: said.write_text("stopped listening"))
said.with_suffix(".ready").write_text("")
time.sleep(120)
"""


def test_stop_kills_a_process_once_done_says_so_without_waiting_out_the_grace(
    tmp_path: Path,
) -> None:
    said = tmp_path / "said"
    argv = [sys.executable, "-c", DRAINS, str(said)]
    proc, record = procs.spawn("drains", argv, tmp_path / "log")
    deadline = time.monotonic() + 30
    while not said.with_suffix(".ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    procs.stop([record], grace_seconds=60, done=said.exists)
    assert time.monotonic() - started < 10  # not the 60 s grace
    assert said.read_text() == "stopped listening"  # it had its SIGTERM first
    assert not procs.alive_groups([record])
    assert proc.wait(timeout=10) == -9
