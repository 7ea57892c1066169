"""Warm spare workers under the real launcher: real etcd, real torch workers over gloo.

What a user must not be able to tell apart from a cold start, apart from the time:
the model trained (same seed, same fault, same losses), exit codes and tracebacks,
log redirects and tee, SIGTERM, and that nothing is left running afterwards.
Every agent runs in its own session and is killed by its recorded group at the end.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import WORKERS, EtcdServer, result_of, start, still_running, wait_for

from elasticjob_devcluster.procs import descendants

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CRASH_ONCE = WORKERS / "crash_once.py"


def train_args(tmp: Path, steps: int = 60) -> list[str]:
    return [
        str(CRASH_ONCE),
        f"--steps={steps}",
        "--checkpoint-interval=10",
        "--log-every=5",
        f"--checkpoint-dir={tmp}",
    ]


def run_with_one_crash(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp: Path, warm: bool
) -> str:
    log = tmp / "agent.log"
    flags = ("--warm-spares",) if warm else ("--no-warm-spares",)
    proc = start(
        agents,
        etcd,
        log,
        train_args(tmp / "ckpt"),
        max_restarts=1,
        launcher_flags=flags,
        env={"CRASH_AT_STEP": "25", "ELASTICJOB_CHECKPOINT_MEMORY_DIR": str(tmp / "shm")},
    )
    wait_for("the job to finish", lambda: proc.poll(), 240, log)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    return text


def test_a_killed_worker_restarts_from_a_warm_spare_and_trains_the_cold_starts_model(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    (tmp_path / "warm").mkdir()
    (tmp_path / "cold").mkdir()
    warm = run_with_one_crash(agents, etcd, tmp_path / "warm", warm=True)
    cold = run_with_one_crash(agents, etcd, tmp_path / "cold", warm=False)

    # Both restarted once after rank 1 died at step 25: from the step-20 checkpoint, or from
    # step 25 when rank 0 got its agent's SIGTERM at a step boundary before gloo's error.
    for text in (warm, cold):
        assert re.search(r"resumed from step (20|25) ", text), text[-3000:]
    starts = re.findall(r"start=(warm|cold)", warm)
    assert starts == ["warm", "warm"], f"rank 0's first start and its restart: {starts}"
    assert re.findall(r"start=(warm|cold)", cold) == ["cold", "cold"]
    # Same seed and same fault: the same model, to the last bit of the held-out loss.
    assert result_of(warm) == result_of(cold)
    # Log windows restart at a resume; from step 30 on they line up whichever step it was.
    losses = [
        [(s, loss) for s, loss in re.findall(r"step=(\d+) .*loss=([0-9.]+)", t) if int(s) >= 30]
        for t in (warm, cold)
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 7


def test_warm_workers_leave_nothing_running_and_obey_sigterm(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    log = tmp_path / "agent.log"
    proc = start(
        agents,
        etcd,
        log,
        [*train_args(tmp_path / "ckpt", steps=1_000_000), "--sleep=0.05"],
        env={"CRASH_AT_STEP": "-1", "ELASTICJOB_CHECKPOINT_MEMORY_DIR": "off"},
    )
    wait_for("training", lambda: True if "step=20 " in log.read_text() else None, 180, log)
    # Two workers, which show the worker's own command line as torch's would, two fresh
    # idle spares (the spares that became workers were replaced at once, forked) and the
    # template they were forked from.
    family = wait_for(
        "the workers, their replacement spares and the template",
        lambda: found if len(found := descendants(proc.pid)) >= 5 else None,
        60,
        log,
    )
    cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in family]
    workers = [c for c in cmdlines if CRASH_ONCE.name.encode() in c]
    assert len(workers) == 2 and all(b"-u " + str(CRASH_ONCE).encode() in c for c in workers)
    spares = [c for c in cmdlines if b"elasticjob_runtime.launch.spare" in c]
    assert len(spares) == 3 and sum(b"--template" in c for c in spares) == 1, cmdlines

    os.kill(proc.pid, signal.SIGTERM)
    wait_for("the agent to exit after SIGTERM", lambda: proc.poll(), 90, log)
    text = log.read_text()
    assert "SIGTERM: saving at the next step boundary" in text  # the workers got it
    assert re.search(r"SIGTERM: saved step \d+", text), text[-3000:]
    alive = still_running(family)
    assert not alive, f"left running after the agent exited: {alive}"


FAILING = """
import sys
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    if sys.argv[1] == "raise":
        raise ValueError("boom from the training script")
    print("exiting with", sys.argv[1], flush=True)
    sys.exit(int(sys.argv[1]))

if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("how", ["raise", "3"])
def test_a_failing_script_reports_the_same_exit_code_and_traceback_warm_or_cold(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path, how: str
) -> None:
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    reports = {}
    for flag in ("--warm-spares", "--no-warm-spares"):
        log = tmp_path / f"{flag}.log"
        proc = start(agents, etcd, log, [str(script), how], nproc=1, launcher_flags=(flag,))
        wait_for("the launcher to give up", lambda: proc.poll(), 120, log)  # noqa: B023
        text = log.read_text()
        assert proc.returncode == 1, text[-3000:]
        root_cause = text[text.index("Root Cause") :]
        reports[flag] = re.sub(r"(time|host|error_file)\b.*", "", root_cause)  # per run
        reports[flag] = re.sub(r"\(pid: \d+\)", "", reports[flag])
    expected = "exitcode  : 1" if how == "raise" else "exitcode  : 3"
    assert expected in reports["--warm-spares"]
    if how == "raise":
        # The error file @record wrote: the user's traceback, no spare or runpy frames.
        assert "ValueError: boom from the training script" in reports["--warm-spares"]
        assert "spare.py" not in reports["--warm-spares"]
    assert reports["--warm-spares"] == reports["--no-warm-spares"]


def test_log_redirects_and_tee_work_for_warm_workers(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    log = tmp_path / "agent.log"
    logs = tmp_path / "logs"
    proc = start(
        agents,
        etcd,
        log,
        [*train_args(tmp_path / "ckpt", steps=20), "--log-ranks=all"],
        launcher_flags=("--redirects=3", "--tee=1", f"--log-dir={logs}"),
        env={"CRASH_AT_STEP": "-1", "ELASTICJOB_CHECKPOINT_MEMORY_DIR": "off"},
    )
    wait_for("the job to finish", lambda: proc.poll(), 180, log)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    for rank in (0, 1):
        stdout = next(logs.glob(f"*/attempt_0/{rank}/stdout.log")).read_text()
        assert "step=20 " in stdout and f"rank={rank}" in stdout and "start=warm" in stdout
    # tee=1: stdout also reaches the agent's console with torch's rank prefix.
    assert re.search(r"\[default1\]:step=20 .*rank=1", text), text[-3000:]
    assert "step=20 " not in "".join(
        p.read_text() for p in logs.glob("*/attempt_0/*/stderr.log")
    ), "stdout leaked into stderr.log"
