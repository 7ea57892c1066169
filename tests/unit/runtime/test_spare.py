"""Warm spares' pure decisions: which worker commands a spare can run, what it imports
ahead of time, when a changed environment forces a cold start, and the hand-over format."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from elasticjob_runtime import contract
from elasticjob_runtime.launch.spare import (
    Target,
    WorkerLaunch,
    parse_worker_command,
    receive_launch,
    script_argv,
    send_launch,
    top_level_imports,
    warm,
)
from elasticjob_runtime.launch.spare_pool import env_differences, spare_count

PY = sys.executable


def test_torchrun_module_and_script_commands_are_runnable_by_a_spare() -> None:
    assert parse_worker_command(PY, ["-u", "-m", "pkg.train", "--lr", "1"], PY) == Target(
        "module", "pkg.train", ("-u",)
    )
    script = parse_worker_command(PY, ["-u", "train.py", "--steps", "3"], PY)
    assert script is not None and script.kind == "script" and script.name.endswith("/train.py")


def test_commands_a_spare_cannot_run_start_cold() -> None:
    assert parse_worker_command("/usr/bin/env", ["train.py"], PY) is None  # --no-python
    assert parse_worker_command(PY, ["-X", "dev", "train.py"], PY) is None  # unknown flag
    assert parse_worker_command(PY, ["-u"], PY) is None  # nothing to run
    assert parse_worker_command(PY, ["-u", "-m"], PY) is None


def test_script_argv_is_what_python_would_set() -> None:
    module = Target("module", "pkg.train", ("-u",))
    assert script_argv(module, ["-u", "-m", "pkg.train", "--lr", "1"]) == ["pkg.train", "--lr", "1"]
    script = Target("script", "/abs/train.py", ("-u",))
    assert script_argv(script, ["-u", "train.py", "-x"]) == ["train.py", "-x"]


def test_top_level_imports_are_found_without_running_the_script() -> None:
    source = """
from __future__ import annotations
import os, numpy as np
from torch import nn
from . import sibling
import json
try:
    import yaml
except ImportError:
    yaml = None
if TYPE_CHECKING:
    import never_at_runtime
if __name__ == "__main__":
    import only_when_main
def f():
    import inside_function
raise SystemExit("the script must not run")
"""
    assert top_level_imports(source) == ["os", "numpy", "torch", "torch.nn", "json", "yaml"]


def test_only_a_changed_non_round_variable_forces_a_cold_start() -> None:
    spare = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "HOME": "/root"}
    worker = {**spare, "RANK": "3", "MASTER_PORT": "1234", "TORCHELASTIC_ERROR_FILE": "/e"}
    worker[contract.ROUND_ID] = "job/3"  # the agent's, per round: a spare takes any
    assert env_differences(spare, worker) == []
    assert env_differences(spare, {**worker, "OMP_NUM_THREADS": "4"}) == ["OMP_NUM_THREADS"]
    assert env_differences(spare, {**worker, "NEW_FLAG": "1"}) == ["NEW_FLAG"]
    assert env_differences({**spare, "GONE": "x"}, worker) == ["GONE"]


def test_the_assignment_and_its_descriptors_cross_the_socket() -> None:
    agent, spare = socket.socketpair()
    r, w = socket.socketpair()
    env = {"RANK": "1", "BIG": "x" * 300_000}  # larger than one socket buffer
    try:
        sent = WorkerLaunch(["-u", "train.py", "--a"], env, stdout=True, stderr=False)
        import threading

        sender = threading.Thread(target=send_launch, args=(agent, sent, [w.fileno()]))
        sender.start()
        received = receive_launch(spare)
        sender.join()
        assert received is not None
        assignment, fds = received
        assert assignment == sent and len(fds) == 1
        with socket.socket(fileno=fds[0]) as passed:
            passed.sendall(b"hello")  # the descriptor is the same socket the agent held
        assert r.recv(5) == b"hello"
        agent.close()
        assert receive_launch(spare) is None  # the agent went away: the spare ends
    finally:
        for s in (agent, spare, r, w):
            s.close()


def test_an_agent_that_closes_without_reading_the_warm_byte_ends_the_spare_quietly() -> None:
    agent, spare = socket.socketpair()
    try:
        spare.sendall(b"w")  # unread when the agent closes: the spare's read gets ECONNRESET
        agent.close()
        assert receive_launch(spare) is None
    finally:
        spare.close()


def test_a_pool_keeps_one_spare_per_local_rank_unless_told_fewer() -> None:
    assert spare_count(None, 4) == 4
    assert spare_count(1, 4) == 1
    assert spare_count(0, 4) == 0
    assert spare_count(8, 4) == 4  # a round never starts more than one worker per rank


def test_spares_are_replaced_once_the_round_trains_or_after_the_delay() -> None:
    from elasticjob_runtime.launch.spare_pool import REFILL_LIMIT_S, refill_due

    assert not refill_due(None, True, 100.0, 5.0)  # nothing taken since the last refill
    assert not refill_due(100.0, False, 102.0, 5.0)  # the workers are still starting
    assert refill_due(100.0, True, 101.0, 5.0)  # the round trains: their start-up is over
    assert refill_due(100.0, False, 105.0, 5.0)  # a script that reports no steps
    # a Run script (it offered to regroup in place) is waited for: its first step may
    # come late (a joiner's, after its peers' regroup), and a spare importing torch on
    # the same cores would slow it
    assert not refill_due(100.0, False, 105.0, 5.0, reports_steps=True)
    assert refill_due(100.0, True, 105.0, 5.0, reports_steps=True)
    assert refill_due(100.0, False, 100.0 + REFILL_LIMIT_S, 5.0, reports_steps=True)


def test_a_lazily_exported_name_is_warmed_through_its_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``from pkg import Name`` where ``pkg`` loads ``Name`` on first read (PEP 562): the
    spare must read it, or the modules behind it load only when the worker starts."""
    pkg = tmp_path / "lazy_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "def __getattr__(name):\n"
        "    import importlib\n"
        "    if name == 'Thing':\n"
        "        return importlib.import_module('lazy_pkg.heavy').Thing\n"
        "    raise AttributeError(name)\n"
    )
    (pkg / "heavy.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert warm("lazy_pkg.Thing")
    assert "lazy_pkg.heavy" in sys.modules
    assert not warm("lazy_pkg.Missing")
    monkeypatch.delitem(sys.modules, "lazy_pkg")
    monkeypatch.delitem(sys.modules, "lazy_pkg.heavy")


def test_the_runtimes_public_face_warms_the_run_and_its_modules() -> None:
    """The examples import ``from elasticjob_runtime import Run``: a warm spare must hold
    the Run's modules before its round (they cost 0.2-0.3 s at a worker's start)."""
    code = (
        "import sys\n"
        "from elasticjob_runtime.launch.spare import Target, warm_up\n"
        "failed = warm_up(Target('module', 'elasticjob_examples.train_regression', ()), [])\n"
        "print(failed, 'elasticjob_runtime.training.run' in sys.modules)\n"
    )
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[-1] == "True", out
