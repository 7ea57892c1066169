"""SIGTERM (eviction, spot reclaim): a real training process saves its latest step and exits.

The test file doubles as the worker: ``python test_checkpoint_sigterm.py <dir> <mode>``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import IO

import pytest
from conftest import EtcdServer, launcher_argv

pytestmark = pytest.mark.integration

# the file doubles as a worker script, which cannot import the repository's packages
REPO = Path(__file__).resolve().parents[3]
EXIT_BOUND_S = 20.0  # generous: catches a worker that ignores SIGTERM, not a speed figure
START_BOUND_S = 180.0


def worker(directory: str, mode: str) -> None:
    """Train a tiny model forever; after step 30 ``stuck`` hangs inside a step and
    ``crash`` fails the step once SIGTERM arrived (as a collective does when the peer
    that got the same SIGTERM has already left)."""
    import torch

    from elasticjob_runtime.checkpoints.manager import CheckpointManager
    from elasticjob_runtime.training.sampler import ElasticSampler

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = ElasticSampler(10_000, 0, 1)
    ckpt = CheckpointManager(directory, keep=2, async_save=True, memory=False)
    state = {"model": model, "optim": opt, "sampler": sampler}
    ckpt.track(state)
    ckpt.install_sigterm_handler(grace_s=3.0 if mode == "stuck" else 15.0)
    step = 0
    while True:
        if mode == "stuck" and step == 30:
            print("stuck", flush=True)
            time.sleep(3600)  # like a collective whose peer vanished
        if mode == "crash" and step == 30:
            print("stuck", flush=True)
            while not ckpt.stop_requested:
                time.sleep(0.05)
            raise RuntimeError("Connection closed by peer")
        x = torch.randn(32, 8)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sampler.advance(32)
        step += 1
        total = sum(float(p.detach().double().sum()) for p in model.parameters())
        print(f"step {step} {total:.10f}", flush=True)
        ckpt.mark_step(step)
        if step % 7 == 0:
            ckpt.save(state, step)


def ddp_worker(out: str) -> None:
    """Two DDP ranks under the agent, training until the agent forwards SIGTERM."""
    import torch
    import torch.distributed as dist

    from elasticjob_runtime.checkpoints.manager import CheckpointManager
    from elasticjob_runtime.training.sampler import ElasticSampler

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = ElasticSampler(100_000, seed=1)
    ckpt = CheckpointManager(Path(out) / "ckpt", keep=2, async_save=True, memory=False)
    state = {"model": model, "optim": opt, "sampler": sampler}
    ckpt.track(state)
    ckpt.install_sigterm_handler(grace_s=10.0)
    step = 0
    while True:
        x = torch.randn(16, 8)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sampler.advance(16 * world)
        step += 1
        if rank == 0:
            total = sum(float(p.detach().double().sum()) for p in net.parameters())
            with (Path(out) / "steps.txt").open("a") as f:
                f.write(f"step {step} {total:.10f}\n")
        ckpt.mark_step(step)
        if step % 5 == 0:
            ckpt.save(state, step)
        time.sleep(0.02)


def start_worker(tmp_path: Path, mode: str) -> subprocess.Popen[str]:
    env = {**os.environ, "ELASTICJOB_CHECKPOINT_MEMORY_DIR": "off", "PYTHONUNBUFFERED": "1"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    return subprocess.Popen(
        [sys.executable, __file__, str(tmp_path / "ckpt"), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def read_until(stream: IO[str], want: str, bound: float) -> list[str]:
    deadline = time.monotonic() + bound
    lines: list[str] = []
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith(want):
            return lines
    raise AssertionError(f"worker never printed {want!r}; output:\n" + "\n".join(lines[-30:]))


def stop_and_collect(proc: subprocess.Popen[str], bound: float) -> tuple[int, list[str], float]:
    """SIGTERM the worker; return its exit code, the rest of its output, seconds to exit."""
    assert proc.stdout is not None
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"worker still running {bound:.0f} s after SIGTERM") from None
    return proc.returncode, out.splitlines(), time.monotonic() - sent


def sigterm_once_started(
    tmp_path: Path, mode: str, marker: str
) -> tuple[list[str], int, list[str], float]:
    """Start a worker in ``mode``, SIGTERM it once it printed ``marker``; return its output
    before, exit code, output after and seconds to exit (killed by group whatever happens)."""
    proc = start_worker(tmp_path, mode)
    try:
        assert proc.stdout is not None
        before = read_until(proc.stdout, marker, START_BOUND_S)
        code, after, took = stop_and_collect(proc, EXIT_BOUND_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return before, code, after, took


def last_step(lines: list[str]) -> tuple[int, float]:
    steps = [line.split() for line in lines if line.startswith("step ")]
    return int(steps[-1][1]), float(steps[-1][2])


def saved_state(tmp_path: Path) -> tuple[int, float, int]:
    from elasticjob_runtime.checkpoints.manager import CheckpointManager

    ckpt = CheckpointManager(tmp_path / "ckpt", memory=False).load_latest()
    assert ckpt is not None, "no committed checkpoint after SIGTERM"
    total = sum(float(t.double().sum()) for t in ckpt.state["model"].values())
    return ckpt.step, total, int(ckpt.state["sampler"]["consumed"])


def test_sigterm_saves_the_latest_step_and_exits_promptly(tmp_path: Path) -> None:
    before, code, after, took = sigterm_once_started(tmp_path, "train", "step 40 ")
    step, total = last_step(before + after)
    assert code == 128 + signal.SIGTERM, "\n".join(after[-20:])
    saved_step, saved_total, consumed = saved_state(tmp_path)
    assert saved_step == step
    assert saved_total == pytest.approx(total, abs=1e-6)
    assert consumed == 32 * step  # the sampler position matches the step that was saved
    assert took < EXIT_BOUND_S
    print(f"SIGTERM to exit with checkpoint of step {step}: {took:.2f} s")


def test_sigterm_while_stuck_in_a_step_saves_from_the_watchdog(tmp_path: Path) -> None:
    before, code, after, took = sigterm_once_started(tmp_path, "stuck", "stuck")
    step, total = last_step(before)
    assert step == 30
    assert code == 128 + signal.SIGTERM, "\n".join(after[-20:])
    saved_step, saved_total, _ = saved_state(tmp_path)
    assert (saved_step, saved_total) == (30, pytest.approx(total, abs=1e-6))
    assert 3.0 <= took < EXIT_BOUND_S  # waited the grace for a step boundary, then saved


def test_sigterm_then_a_failing_step_still_saves_at_exit(tmp_path: Path) -> None:
    before, code, after, took = sigterm_once_started(tmp_path, "crash", "stuck")
    step, total = last_step(before)
    assert code == 1 and any("Connection closed by peer" in line for line in after), after
    saved_step, saved_total, _ = saved_state(tmp_path)
    assert (saved_step, saved_total) == (step, pytest.approx(total, abs=1e-6))
    assert took < 10.0  # no waiting out the watchdog's grace


def test_sigterm_to_the_agent_leaves_a_checkpoint_of_the_last_ddp_step(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    """The eviction path: the kubelet signals the launcher, torch's agent forwards SIGTERM."""
    cmd = launcher_argv(
        etcd.endpoint,
        f"sigterm-{uuid.uuid4().hex[:8]}",
        [__file__, str(tmp_path), "ddp"],
        nproc=2,
    )
    env = {**os.environ, "ELASTICJOB_CHECKPOINT_MEMORY_DIR": "off", "GLOO_SOCKET_IFNAME": "lo"}
    log = tmp_path / "agent.log"
    proc = subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    steps = tmp_path / "steps.txt"
    try:
        deadline = time.monotonic() + START_BOUND_S
        while not (steps.exists() and steps.read_text().count("\n") >= 20):
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "training never reached step 20"
            time.sleep(0.2)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # to the agent only, as the kubelet does
        proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    step, total = last_step(steps.read_text().splitlines())
    saved_step, saved_total, consumed = saved_state(tmp_path)
    assert saved_step == step, log.read_text(errors="replace")[-3000:]
    assert saved_total == pytest.approx(total, abs=1e-6)
    assert consumed == 32 * step
    assert took < 25.0  # well inside the agent's 30 s before SIGKILL
    print(f"agent SIGTERM to exit with checkpoint of DDP step {step}: {took:.2f} s")


def test_a_step_the_example_saved_on_sigterm_is_on_its_samples_record_as_committed(
    tmp_path: Path,
) -> None:
    """The example exits 143 from inside ``run.step()`` once SIGTERM saved the step; the
    e2e preemption test read that step as never committed, and its samples as skipped."""
    sys.path.insert(0, str(REPO / "examples"))
    import sample_audit

    cmd = [
        sys.executable,
        "-u",
        str(REPO / "examples" / "train_regression.py"),
        "--steps=10000",
        "--sleep=0.1",
        "--log-samples=1",
        "--log-every=1",
        f"--checkpoint-dir={tmp_path / 'ckpt'}",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + START_BOUND_S
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("step=5 "):
                break
            assert time.monotonic() < deadline, "training never reached step 5"
        proc.send_signal(signal.SIGTERM)  # most likely in the sleep after a step
        lines += proc.communicate(timeout=EXIT_BOUND_S)[0].splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, "\n".join(lines[-20:])
    records = sample_audit.parse_all(lines)
    trained = max(r.step for r in records if isinstance(r, sample_audit.Samples))
    assert any(re.search(rf"SIGTERM: saved step {trained}\b", line) for line in lines), lines[-10:]
    assert max(sample_audit.committed_attempts(records)) == trained, lines[-10:]


if __name__ == "__main__":
    if sys.argv[2] == "ddp":
        ddp_worker(sys.argv[1])
    else:
        worker(sys.argv[1], sys.argv[2])
