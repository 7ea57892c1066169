"""A checkpoint directory that fills up or turns read-only (real tmpfs mounts): the failed
saves are said once, what was saved before stays and is what a restart loads, no temp
file is left behind, and training goes on; saves work again once the directory does.
Under ``elasticjob-run`` (real etcd) the failure reaches the progress record, and from it
the job's ``status.progress.checkpointError``.

Each scenario runs in a worker with a mount namespace of its own, so its mounts can
outlive nothing: it mounts a 1 MiB tmpfs as the checkpoint directory (``mount -t tmpfs
-o size=1m``), remounts it read-only for the read-only case (root ignores permission
bits, so a chmod alone would prove nothing; the EACCES case drops CAP_DAC_OVERRIDE
first) and unmounts it at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import EtcdServer, launcher_argv, result_of, wait_for

from elasticjob_operator import observe
from elasticjob_operator.etcd import reader as etcd_reader

pytestmark = pytest.mark.integration

BOUND_S = 180.0
RESULT = "FAULT-RESULT "

WORKER = textwrap.dedent(
    """
    import ctypes, json, logging, subprocess, sys
    from pathlib import Path
    import torch
    from elasticjob_runtime.checkpoints.manager import CheckpointManager
    from elasticjob_runtime.checkpoints.files import committed_steps, read_verified

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        print("SKIP unshare(CLONE_NEWNS) not permitted"); sys.exit(0)
    assert libc.mount(None, b"/", None, (1 << 14) | (1 << 18), None) == 0  # rec, private
    ckpt_dir, fault, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    ckpt_dir.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(ckpt_dir)])
    if mounted.returncode != 0:
        print("SKIP mount -t tmpfs not permitted"); sys.exit(0)

    said = []
    class Keep(logging.Handler):
        def emit(self, record):
            said.append((record.levelname, record.getMessage()))
    logging.getLogger("elasticjob_runtime").addHandler(Keep())

    def param_sum(model):
        return sum(float(p.detach().double().sum()) for p in model.parameters())

    out = {}
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(32, 32)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        mgr = CheckpointManager(ckpt_dir, keep=2, memory=False, writer=True,
                                async_save=mode == "async")
        sums = {}
        for step in range(1, 9):
            loss = model(torch.randn(8, 32)).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            sums[step] = param_sum(model)
            if step == 4 and fault == "readonly":
                subprocess.run(["mount", "-o", "remount,ro", str(ckpt_dir)], check=True)
            if step == 7 and fault == "readonly":
                subprocess.run(["mount", "-o", "remount,rw", str(ckpt_dir)], check=True)
            if fault == "forbidden" and step in (4, 7):
                ckpt_dir.chmod(0o555 if step == 4 else 0o755)
            # about 100 KiB a checkpoint, but 900 KiB at steps 4 to 6: with two kept,
            # those cannot fit in 1 MiB
            pad = 900 if fault == "full" and 4 <= step <= 6 else 100
            mgr.save({"model": model, "optim": opt, "pad": torch.zeros(pad * 256)}, step)
            if step == 6:
                mgr.wait()
                out["error_at_6"] = mgr.save_error
                out["steps_at_6"] = committed_steps(ckpt_dir)
                out["intact_at_6"] = [read_verified(ckpt_dir, s)[1] for s in out["steps_at_6"]]
                out["names_at_6"] = sorted(p.name for p in ckpt_dir.iterdir())
                again = CheckpointManager(ckpt_dir, memory=False).load_latest()
                out["restored_step"] = again.step
                restored = torch.nn.Linear(32, 32)
                restored.load_state_dict(again.state["model"])
                out["restored_matches"] = abs(param_sum(restored) - sums[again.step]) < 1e-9
        mgr.close()
        out["trained_to"] = step
        out["error_at_end"] = mgr.save_error
        out["steps_at_end"] = committed_steps(ckpt_dir)
        out["said"] = said
    finally:
        subprocess.run(["umount", str(ckpt_dir)])
    print("FAULT-RESULT " + json.dumps(out))
    """
)


def run_scenario(
    tmp_path: Path, fault: str, mode: str, prefix: tuple[str, ...] = ()
) -> dict[str, Any]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs in a mount namespace of its own needs root")
    ckpt_dir = tmp_path / "ckpt"
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", WORKER, str(ckpt_dir), fault, mode],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    if text.startswith("SKIP "):
        pytest.skip(text.splitlines()[0][5:])
    line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT)), None)
    assert line is not None, text[-3000:]
    result: dict[str, Any] = json.loads(line[len(RESULT) :])
    assert not ckpt_dir.is_mount()  # the worker's mounts went with it
    return result


def check(result: dict[str, Any], ckpt_dir: Path, errno_name: str) -> None:
    # steps 4 to 6 failed; 2 and 3, saved before, are there and intact, and a restart loads 3
    assert result["steps_at_6"] == [2, 3]
    assert result["intact_at_6"] == ["", ""]
    assert result["restored_step"] == 3 and result["restored_matches"]
    assert not [n for n in result["names_at_6"] if ".tmp." in n or n.startswith(".")]
    assert result["names_at_6"] == [
        "step-0000000002.pt",
        "step-0000000002.pt.commit",
        "step-0000000003.pt",
        "step-0000000003.pt.commit",
    ]
    assert result["error_at_6"] == (
        f"checkpoint step 6 not saved in {ckpt_dir}: {errno_name} "
        f"({os.strerror(getattr(__import__('errno'), errno_name))}); step 3, the newest "
        "checkpoint there, stands and training goes on"
    )
    errors = [msg for level, msg in result["said"] if level == "ERROR"]
    assert errors == [result["error_at_6"].replace("step 6", "step 4")]  # once for 3 failures
    # training went on, and saves work again once the directory does
    assert result["trained_to"] == 8
    assert result["steps_at_end"] == [7, 8] and result["error_at_end"] is None
    assert any("saves work again" in msg for _, msg in result["said"])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_checkpoint_directory_keeps_the_last_good_checkpoint_and_training_goes_on(
    tmp_path: Path, mode: str
) -> None:
    result = run_scenario(tmp_path, "full", mode)
    check(result, tmp_path / "ckpt", "ENOSPC")


def test_a_read_only_checkpoint_directory_keeps_the_last_good_checkpoint_and_training_goes_on(
    tmp_path: Path,
) -> None:
    result = run_scenario(tmp_path, "readonly", "sync")
    check(result, tmp_path / "ckpt", "EROFS")


# The agent's own mount namespace (its workers inherit it): a read-only tmpfs as the
# checkpoint directory, then the launcher in this very process.
READ_ONLY_AGENT = textwrap.dedent(
    """
    import ctypes, os, subprocess, sys
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.unshare(0x00020000) == 0, "unshare(CLONE_NEWNS)"
    assert libc.mount(None, b"/", None, (1 << 14) | (1 << 18), None) == 0  # rec, private
    target = sys.argv[1]
    os.makedirs(target)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", target], check=True)
    os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
    """
)


def test_a_read_only_directory_under_the_agent_reaches_the_jobs_status_and_training_ends(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs in a mount namespace of its own needs root")
    ckpt, run_id = tmp_path / "ckpt", f"rofault-{uuid.uuid4().hex[:8]}"
    script = [
        str(Path(__file__).parents[3] / "examples" / "train_regression.py"),
        "--steps=150",
        "--checkpoint-interval=10",
        "--sleep=0.05",
        "--log-every=50",
        f"--checkpoint-dir={ckpt}",
    ]
    argv = launcher_argv(etcd.endpoint, run_id, script, nproc=2)
    log = tmp_path / "agent.log"
    env = {**os.environ, "ELASTICJOB_HEALTH_PORT": "0", "PYTHONUNBUFFERED": "1"}
    env["ELASTICJOB_CHECKPOINT_MEMORY_DIR"] = "off"  # the directory's failure alone
    proc = subprocess.Popen(
        [sys.executable, "-c", READ_ONLY_AGENT, str(ckpt), *argv[1:]],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    agents.append(proc)

    def status_with_error() -> Any:
        raw = etcd_reader.read_run_records(etcd.endpoint, run_id, memory_fallbacks=False)
        status = observe.progress_of(raw.progress)
        return status if status is not None and status.checkpoint_error else None

    status = wait_for("status.progress.checkpointError", status_with_error, 120, log)
    wait_for("the job to finish", lambda: proc.poll(), 120, log)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-3000:]  # training went on to its end
    assert result_of(text)["steps"] == 150
    assert status.checkpoint_error.startswith("checkpoint step ")
    assert status.checkpoint_error.endswith(
        f"not saved in {ckpt}: EROFS (Read-only file system); nothing was saved there "
        "before and training goes on"
    )
    assert text.count(f"not saved in {ckpt}: EROFS") == 1, text[-3000:]  # said once
    assert not ckpt.is_mount() and not any(ckpt.iterdir())  # the agent's mount went with it


def test_a_forbidden_checkpoint_directory_keeps_the_last_good_checkpoint_and_training_goes_on(
    tmp_path: Path,
) -> None:
    """Root ignores permission bits; without CAP_DAC_OVERRIDE (dropped from the bounding
    set, so the worker's root has it no more) a directory made 0555 refuses with EACCES."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed: cannot drop CAP_DAC_OVERRIDE")
    drop = (setpriv, "--bounding-set=-dac_override,-dac_read_search")
    result = run_scenario(tmp_path, "forbidden", "sync", drop)
    check(result, tmp_path / "ckpt", "EACCES")
