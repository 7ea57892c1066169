"""A SIGTERM save away from the step boundary never records a state an optimizer update
has changed past the step it names.

The worker (``workers/sigterm_mid_update.py``, an ``Run``) stops in the middle of
step 6's optimizer update, or just before it; the test SIGTERMs it there. Saving "the
last completed step" (5) from the watchdog mid-update would write step 6's first
parameter beside step 5's others: that is how two workers woken from a hang restored
different "step 31"s. Every checkpoint left must equal the deterministic training's
state at the step it names.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from conftest import WORKERS

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GATE_STEP = 6  # the Run checkpoints steps 2 and 4 before it (CHECKPOINT_INTERVAL 2)
BROKEN_GRACE_S = 4.0


def worker_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "sigterm_mid_update", WORKERS / "sigterm_mid_update.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def differences(saved: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """What in ``saved`` (a checkpoint's state) is not ``want`` (the reference's)."""
    out = [
        f"model.{name}"
        for name, tensor in want["model"].items()
        if not torch.equal(saved["model"][name], tensor)
    ]
    for index, entry in want["optim"]["state"].items():
        buf = saved["optim"]["state"].get(index, {}).get("momentum_buffer")
        if buf is None or not torch.equal(buf, entry["momentum_buffer"]):
            out.append(f"optim.state[{index}].momentum_buffer")
    return out


def committed_steps(directory: Path) -> list[int]:
    return sorted(
        int(p.name.split("-")[1].split(".")[0]) for p in directory.glob("step-*.pt.commit")
    )


def sigterm_in_step(tmp_path: Path, *, at: str, broken: bool, grace: float, release: bool) -> str:
    """Run the worker to step 6's gate (``at``: mid or before the update), SIGTERM it (with
    the agent's group-broken mark when ``broken``), open the gate a second later when
    ``release``; return its output, once it exited 143."""
    channel, gate = tmp_path / "channel", tmp_path / "gate"
    channel.mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
        "CKPT_DIR": str(tmp_path / "ckpt"),
        "CHECKPOINT_INTERVAL": "2",
        "SIGTERM_GRACE": str(grace),
        "GATE_STEP": str(GATE_STEP),
        "GATE": str(gate),
        "GATE_AT": at,
        # the agent channel elasticjob-run's agent would own: only its group-broken mark
        "ELASTICJOB_AGENT_CHANNEL": str(channel),
        "PYTHONUNBUFFERED": "1",
    }
    proc = subprocess.Popen(
        [sys.executable, str(WORKERS / "sigterm_mid_update.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    assert proc.stdout is not None
    try:
        lines: list[str] = []
        while not lines or lines[-1] != f"{at}-update":
            line = proc.stdout.readline()
            assert line, "the worker ended before its gated update:\n" + "\n".join(lines)
            lines.append(line.rstrip("\n"))
        if broken:  # what the agent does before it stops workers whose round lost a peer
            (channel / "group-broken").touch()
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # a watchdog saving at once has saved by now
        if release:
            gate.touch()
        rest, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    output = "\n".join(lines) + "\n" + rest
    assert proc.returncode == 128 + signal.SIGTERM, output
    return output


@pytest.mark.parametrize(
    ("at", "broken", "grace", "release", "newest", "said"),
    [
        # the group lost a peer, and the update finishes: its step is saved at the boundary
        ("mid", True, BROKEN_GRACE_S, True, GATE_STEP, "saving at the step boundary instead"),
        # the group lost a peer, and the update never finishes: no save; step 4 stands
        ("mid", True, BROKEN_GRACE_S, False, GATE_STEP - 2, "exiting without a save"),
        # a plain SIGTERM whose grace runs out mid-update: no save either
        ("mid", False, 1.0, False, GATE_STEP - 2, "exiting without a save"),
        # before the update: step 5 is saved, and the update waits until the process is gone
        ("before", True, BROKEN_GRACE_S, False, GATE_STEP - 1, "saved step 5"),
    ],
    ids=[
        "broken-update-finishes",
        "broken-update-stuck",
        "grace-ends-mid-update",
        "broken-before-update",
    ],
)
def test_a_sigterm_in_a_step_saves_no_state_past_its_step(
    tmp_path: Path,
    at: str,
    broken: bool,
    grace: float,
    release: bool,
    newest: int,
    said: str,
) -> None:
    output = sigterm_in_step(tmp_path, at=at, broken=broken, grace=grace, release=release)
    worker = worker_module()
    steps = committed_steps(tmp_path / "ckpt")
    for step in steps:
        saved = torch.load(tmp_path / "ckpt" / f"step-{step:010d}.pt", weights_only=True)
        assert saved["run"]["step"] == step
        wrong = differences(saved, worker.reference(step))
        assert not wrong, f"checkpoint step {step} is not step {step}'s state: {wrong}\n{output}"
    assert steps and steps[-1] == newest, f"{steps}\n{output}"
    assert said in output, output
