"""A job's identity: unique to the job, the same across its restarts."""

from __future__ import annotations

import os
import subprocess
import sys

from elasticjob_runtime.checkpoints.job_identity import (
    directory_name,
    endpoint_from_argv,
    job_identity,
)

TORCHRUN = ["/usr/bin/python", "-m", "torch.distributed.run", "--nnodes=2"]


def test_under_the_operator_namespace_uid_and_run_id_name_the_job() -> None:
    env = {"ELASTICJOB_JOB_UID": "u-1", "ELASTICJOB_NAMESPACE": "ml", "PET_RDZV_ID": "u-1-2"}
    assert job_identity(env, [], None, 7) == "k8s/ml/u-1/u-1-2"
    assert job_identity({**env, "TORCHELASTIC_RUN_ID": "u-1-2"}, TORCHRUN, None, 8) == (
        "k8s/ml/u-1/u-1-2"
    )


def test_under_torchrun_run_id_and_the_agents_endpoint_name_the_job() -> None:
    env = {"TORCHELASTIC_RUN_ID": "none"}
    a = job_identity(env, [*TORCHRUN, "--rdzv-endpoint=10.0.0.1:2379", "train.py"], None, 1)
    b = job_identity(env, [*TORCHRUN, "--rdzv_endpoint", "10.0.0.2:2379", "train.py"], None, 2)
    assert a == "torchrun/none@10.0.0.1:2379" and b == "torchrun/none@10.0.0.2:2379"
    # the agent's flag wins over the environment, as in torchrun
    env_too = {**env, "PET_RDZV_ENDPOINT": "10.0.0.9:2379"}
    assert job_identity(env_too, [*TORCHRUN, "--rdzv-endpoint=10.0.0.1:2379"], None, 3) == a
    assert job_identity(env_too, TORCHRUN, None, 3) == "torchrun/none@10.0.0.9:2379"


def test_a_process_no_launcher_started_shares_with_nobody() -> None:
    assert job_identity({}, ["bash"], None, 41) == "process/41"
    assert job_identity({}, ["bash"], "given", 41) == "torchrun/given@"


def test_the_endpoint_is_the_agents_first_flag_not_the_scripts() -> None:
    argv = [*TORCHRUN, "--rdzv-endpoint", "a:1", "train.py", "--rdzv-endpoint=b:2"]
    assert endpoint_from_argv(argv) == "a:1"
    assert endpoint_from_argv([*TORCHRUN, "--rdzv-endpoint"]) is None


def test_directory_names_are_readable_and_differ_per_identity() -> None:
    one, two = directory_name("torchrun/none@a:1"), directory_name("torchrun/none@b:1")
    assert one.startswith("none-") and two.startswith("none-") and one != two
    assert directory_name("k8s/ml/u-1/u-1-2").startswith("ml_u-1_u-1-2-")
    assert "/" not in directory_name("torchrun/../../etc@x")


def test_an_agent_computes_the_identity_its_workers_compute() -> None:
    """The agent removes its workers' node-memory copy by this identity: a child reads the
    parent's command line and environment, so both must come out the same."""
    run = "run-7"
    child = (
        "import os; os.environ['TORCHELASTIC_RUN_ID'] = 'run-7'; "
        "from elasticjob_runtime.checkpoints.job_identity import current_job; print(current_job())"
    )
    parent = (
        "import subprocess, sys; "
        "from elasticjob_runtime.checkpoints.job_identity import workers_job; "
        f"print(workers_job({run!r})); sys.stdout.flush(); "
        f"subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    )
    out = subprocess.run(
        [sys.executable, "-c", parent, "--rdzv-endpoint=10.0.0.1:2379"],
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ELASTICJOB_"))},
    )
    agent, worker = out.stdout.split()
    assert agent == worker == "torchrun/run-7@10.0.0.1:2379"
