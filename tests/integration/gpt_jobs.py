"""Jobs of examples/train_gpt.py (and its FSDP2 form) under the real launcher, with faults
at exact steps (workers/gpt_faults.py), and the comparisons that prove a faulted run
trains what an unfaulted run with the same world history trains."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import torch
from conftest import WORKERS, EtcdServer, result_of, start, wait_for
from elasticjob_examples import sample_audit

from elasticjob_runtime import contract
from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.etcd.endpoints import parse_endpoints
from elasticjob_runtime.etcd.records import Divergence, decode_divergence

GPT_FAULTS = WORKERS / "gpt_faults.py"
SAMPLES = 256
STEPS = 40


def gpt_args(tmp: Path, *extra: str) -> list[str]:
    """A small model (the same code as the 3.3M default), so a run takes seconds."""
    return [
        str(GPT_FAULTS),
        f"--steps={STEPS}",
        f"--samples={SAMPLES}",
        "--batch-size=4",
        "--accumulate=2",
        "--workers=2",
        "--seq=16",
        "--vocab=64",
        "--dim=32",
        "--layers=2",
        "--heads=2",
        "--warmup=10",
        "--log-every=5",
        "--log-state=1",
        "--log-samples=1",
        f"--checkpoint-dir={tmp / 'ckpt'}",
        "--checkpoint-interval=10",
        *extra,
    ]


def states(text: str) -> dict[int, set[str]]:
    """Step -> the fingerprints every rank logged after it (one value when they agree)."""
    found: dict[int, set[str]] = {}
    for step, values in re.findall(r"^state step=(\d+) rank=\d+ world=\d+ (.*)$", text, re.M):
        found.setdefault(int(step), set()).add(values)
    return found


def worlds(text: str) -> dict[int, int]:
    """Step -> the world size it was trained at."""
    return {
        int(s): int(w) for s, w in re.findall(r"^state step=(\d+) rank=\d+ world=(\d+)", text, re.M)
    }


def assert_same_training(
    faulted: str, reference: str, unlogged: frozenset[int] = frozenset()
) -> None:
    """Every step's fingerprints the same in both runs; ``unlogged``: steps the faulted
    run committed but did not log (a worker told to stop exits inside the step's block,
    before the script's own logging after it)."""
    ours, theirs = states(faulted), states(reference)
    assert sorted(ours) == sorted(set(range(1, STEPS + 1)) - unlogged), sorted(ours)
    assert worlds(faulted) == {s: w for s, w in worlds(reference).items() if s not in unlogged}
    split = {step: values for step, values in ours.items() if len(values) > 1}
    assert not split, f"ranks disagree at steps {sorted(split)}"
    differ = [step for step in ours if ours[step] != theirs.get(step)]
    assert not differ, f"the faulted run differs from the unfaulted one at steps {differ}"
    assert result_of(faulted) == result_of(reference)


# Plain SGD, no clipping, no dropout: an update is the learning rate times the averaged
# gradient, so a sum where an average belongs shows at once.
PLAIN_SGD = ("--dropout=0", "--optimizer=sgd", "--clip=0", "--lr=0.5")


def assert_trains_like_one_process(
    sharded: Path, tmp: Path, extra: tuple[str, ...], global_batch: int
) -> None:
    """The whole model a sharded run dumped (``--dump``) is, within 1e-5, what one
    process of examples/train_gpt_fsdp.py trains on the same global batch (``extra`` the
    sharded run's flags, PLAIN_SGD among them)."""
    assert SAMPLES % global_batch == 0  # every step a full global batch in both runs
    alone = tmp / "alone.pt"
    # micro-batches of global_batch / 2: gpt_args accumulates two
    batch = f"--batch-size={global_batch // 2}"
    args = gpt_args(tmp / "one", *extra, batch, f"--dump={alone}")
    out = subprocess.run(
        [sys.executable, *args],
        env={**os.environ, "GPT_SCRIPT": "train_gpt_fsdp"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert result_of(out.stdout)["samples"] == result_of(out.stdout)["steps"] * global_batch
    ours, theirs = torch.load(sharded), torch.load(alone)
    assert sorted(ours) == sorted(theirs)
    worst = max(float((ours[k] - theirs[k]).abs().max()) for k in ours)
    assert worst < 1e-5, f"the sharded run is {worst} away from one process (at most 1e-5)"


def assert_every_sample_once_per_epoch(text: str) -> None:
    """Every step 1..STEPS one full group that committed, every sample once an epoch
    (sample_audit.py: a step dropped in a fault counts only where it was redone)."""
    found = sample_audit.audit(sample_audit.parse_all(text.splitlines()), SAMPLES, STEPS)
    assert not found.problems, found.problems
    assert found.epochs >= 2, found.epochs


def divergence_records(etcd: EtcdServer, run_id: str) -> list[Divergence]:
    """What the run's workers recorded for the operator (its rule "Divergence")."""
    client = EtcdClient(parse_endpoints(etcd.endpoint, 2379))
    try:
        items = client.snapshot(contract.divergence_prefix(run_id)).items
    finally:
        client.close()
    return [decode_divergence(kv.value) for kv in items.values()]


def run_job(
    agents: list[subprocess.Popen[bytes]],
    etcd: EtcdServer,
    tmp: Path,
    env: dict[str, str],
    nodes: int,
    nnodes: str,
    joiner: str | None = None,
    expect_ok: bool = True,
    run_id: str | None = None,
    extra: tuple[str, ...] = (),
    nproc: int = 1,
) -> str:
    """``nodes`` agents of ``nproc`` workers each; a ``joiner`` agent starts once the log
    shows that line. Returns every agent's log, joined."""
    tmp.mkdir(parents=True, exist_ok=True)
    run_id = run_id or f"gpt-{uuid.uuid4().hex[:8]}"
    env = {"ELASTICJOB_CHECKPOINT_MEMORY_DIR": str(tmp / "shm"), **env}
    logs = [tmp / f"agent-{n}.log" for n in range(nodes)]

    def agent(log: Path) -> subprocess.Popen[bytes]:
        args = gpt_args(tmp, *extra)
        return start(
            agents,
            etcd,
            log,
            args,
            nproc=nproc,
            nnodes=nnodes,
            max_restarts=2,
            run_id=run_id,
            env=env,
        )

    procs = [agent(log) for log in logs]
    if joiner is not None:
        wait_for(
            joiner,
            lambda: True if any(joiner in log.read_text() for log in logs) else None,
            240,
            logs[0],
        )
        logs.append(tmp / "agent-joiner.log")
        procs.append(agent(logs[-1]))
    for proc, log in zip(procs, logs, strict=True):
        wait_for("the job to end", lambda p=proc: p.poll(), 300, log)
        if expect_ok:
            ok = {0, 143} if "LEAVE_AT_STEP" in env else {0}  # a node that left exits 143
            assert proc.returncode in ok or "LOSE_NODE_AT_STEP" in env, log.read_text()[-4000:]
    text = "\n".join(log.read_text() for log in logs)
    assert_on_the_asked_device(text)
    return text


def assert_on_the_asked_device(text: str) -> None:
    """Every worker started on the device ``ELASTICJOB_DEVICE`` names, where it names one
    (bench/gpu.py runs these tests with every worker on ``cuda:0``)."""
    asked = os.environ.get("ELASTICJOB_DEVICE")
    if asked is not None:
        devices = set(re.findall(r"^started \(.* device=(\S+) ", text, re.M))
        assert devices == {asked}, f"asked for {asked}, workers started on {devices}"
