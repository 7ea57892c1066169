"""An unchanged classic torchelastic script under both launchers: where a restart's seconds go.

bench/classic_imagenet.py is an ImageNet-style script written the classic torchelastic way
(``init_process_group`` from the launcher's environment, a torchvision-sized ResNet-18
built in the script, ``ElasticDistributedSampler``, a ``DataLoader`` with 2 worker
processes, its own ``torch.save`` checkpoint every 20 steps). It knows nothing of
elasticjob, so every fault restarts its workers under either launcher: ``elasticjob-run``
hands the new round to warm spares (the script does not use the training-loop API, so
nothing regroups in place), ``torchrun`` starts fresh interpreters. Both run it unchanged
with the same flags; its checkpoint file lies in the job's work directory.

* ``classic-worker-kill``, ``classic-node-kill``, ``classic-scale-up``: ``bench.run``'s
  worker-kill, node-kill and scale-up with this script. Every rank logs its steps; only
  rank 0's count (:func:`bench.harness.parse_step_line`).

``--scenarios classic`` runs the three (not in the default set). Each recovery is split
(:func:`bench.phases.classic_breakdown`) into the launcher's phases (detect, rendezvous,
worker start: the process exec or the spare's hand-over up to the script's ``imports``
mark) and the script's own (its ``startup phase=`` marks: process group, model,
checkpoint, DDP, loader, then the first step).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench import groups, phases, real_scripts
from bench.launchers import scripts
from bench.report import Figure, render

OURS = "elasticjob-run"
SCRIPT = scripts.CLASSIC
GROUP = "classic"  # --scenarios classic
FAULTS = {  # -> bench.run's scenario
    "classic-worker-kill": "worker-kill",
    "classic-node-kill": "node-kill",
    "classic-scale-up": "scale-up",
}
SCENARIOS = tuple(FAULTS)
CHECKPOINT_INTERVAL = 20
# The script's defaults spelled out (a change of default shows here), small and fast:
# 64-pixel images, 8 per rank, 2 DataLoader workers, one intra-op thread per rank.
ARGS = [
    "--epochs=100",
    "--steps=1000000",
    "--batch-size=8",
    "--samples=4096",
    "--classes=1000",
    "--image-size=64",
    "--workers=2",
    "--threads=1",
    f"--checkpoint-interval={CHECKPOINT_INTERVAL}",
]
# (scenario, summary key, metric, target in seconds or None)
TARGETS = (
    ("classic-worker-kill", "seconds", "SIGKILL a worker -> next step", 2.0),
    ("classic-worker-kill", "pause", "training paused (last step -> next step)", None),
    ("classic-node-kill", "seconds", "SIGKILL an agent (3->2) -> next step", 3.0),
    ("classic-node-kill", "pause", "training paused (last step -> next step)", None),
    ("classic-scale-up", "seconds", "agent joins (2->3) -> step at 3", None),
    ("classic-scale-up", "pause", "training paused (last step -> next step)", 3.0),
)
# Whose seconds each phase is: the launcher's (it could remove them without touching the
# script) or the script's (what the script does when it starts, whoever launched it).
OWNER = {
    "detect": "launcher",
    "rendezvous": "launcher",
    "worker_start": "launcher",
    "process_group": "script",
    "model": "script",
    "checkpoint": "script",
    "ddp": "script",
    "loader": "script",
    "first_step": "script",
}
PHASE_NAMES = {
    "detect": "detect (fault -> an agent stops its workers)",
    "rendezvous": "rendezvous (-> the last agent starts its workers)",
    "worker_start": "worker start (exec or spare hand-over -> script's imports done)",
    "process_group": "process group (init_process_group)",
    "model": "model (ResNet-18, SGD: a cold process's first optimizer imports torch._dynamo)",
    "checkpoint": "checkpoint (torch.load + load_state_dict)",
    "ddp": "ddp (DistributedDataParallel(model))",
    "loader": "loader (DataLoader workers forked, first batch)",
    "first_step": "first step (forward, backward, all-reduce, SGD)",
}


def train_args(workdir: Path) -> list[str]:
    """The script's flags for one job: its checkpoint file in the job's directory."""
    return [*ARGS, f"--checkpoint-file={workdir / 'classic-ckpt' / 'checkpoint.pth.tar'}"]


def expand(scenarios: Iterable[str]) -> list[str]:
    """``--scenarios`` with this group's name replaced by its scenarios."""
    return groups.expand(scenarios, GROUP, SCENARIOS)


def figures(
    summary: dict[str, dict[str, dict[str, Any]]], launchers: Sequence[str]
) -> list[Figure]:
    """Each target's figure, ours beside each torchrun launcher, from bench.run's summary."""
    return real_scripts.fault_figures(
        summary,
        launchers,
        TARGETS,
        "classic_imagenet.py, unchanged",
        baseline_name=lambda launcher: launcher,
        note_name=lambda launcher: launcher,
    )


def owned(split: dict[str, float]) -> dict[str, float]:
    """A breakdown's seconds summed by owner (:data:`OWNER`): launcher, script."""
    out = {"launcher": 0.0, "script": 0.0}
    for name, seconds in split.items():
        if name in OWNER:
            out[OWNER[name]] += seconds
    return {k: round(v, 2) for k, v in out.items()}


def breakdown_table(summary: dict[str, dict[str, dict[str, Any]]], launchers: Sequence[str]) -> str:
    """Per scenario and phase, each launcher's median seconds and whose they are; the
    launcher's and the script's totals under each scenario."""
    rows = [["scenario", "phase", "whose", *launchers]]
    for scenario in SCENARIOS:
        cells = [summary.get(lch, {}).get(scenario) or {} for lch in launchers]
        meds = [c.get("phases_median") for c in cells]
        if not any(meds):
            continue
        for name in phases.CLASSIC:
            row = [scenario, PHASE_NAMES[name], OWNER[name]]
            row += [f"{m[name]:.2f}" if m and name in m else "-" for m in meds]
            rows.append(row)
        for who in ("launcher", "script"):
            row = [scenario, f"**sum: the {who}'s**", who]
            row += [f"{owned(m)[who]:.2f}" if m else "-" for m in meds]
            rows.append(row)
    return render(rows) if len(rows) > 1 else ""
