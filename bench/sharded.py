"""A sharded model (FSDP2) through faults: in place beside the restart path and torchrun.

examples/train_gpt_fsdp.py (``run.shard``) runs under ``elasticjob-run`` (in place: shards
move from memory on a join, the newest DCP checkpoint is read in place when a rank took
the only copy of its shard) and under ``elasticjob-run-restart`` (the same script with
in-place recovery off: every worker restarts from a warm spare and reads the DCP
checkpoint); bench/gpt_fsdp_plain.py, the same model written for torchrun with its own
DCP checkpoint, runs under each torchrun launcher. Same flags, same seed.

* ``fsdp-throughput``: samples/s at world 2 over the steps of :data:`WINDOW` (no save
  inside it), ours (shard copies every 10 steps, the default) beside each other launcher
  (``bench.real_scripts``' steady state); ``fsdp-throughput-no-copies``: the same with
  ``--copy-every=0`` under ours.
* ``fsdp-throughput-saving``: the same window with a DCP save every
  :data:`CHECKPOINT_INTERVAL` steps inside it; ours writes its saves in the background
  (checkpoints/sharded.py), the plain script on its training thread, so the target is
  to be ahead (1.0).
* ``fsdp-worker-kill``, ``fsdp-node-kill``, ``fsdp-scale-up``: ``bench.run``'s
  worker-kill, node-kill and scale-up with these scripts.
* ``hsdp-worker-kill``: four agents, HSDP 2 x 2 (``--shard-group-size=2``, a smaller
  model: :data:`HSDP_ARGS`), one worker SIGKILLed: in place the other replica holds its
  shard, so no step is redone; beside ours with in-place recovery off only.

``--scenarios fsdp`` runs the seven (not in the default set). The model (29M parameters:
8 blocks of width 512, a 4096-token vocabulary) makes a step of about half a second at
world 2 on 2 cores (63M, width 768, took 1.4 s: too slow for a bench that trains 40 steps
before each fault); it is checkpointed every :data:`CHECKPOINT_INTERVAL` steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench import groups, real_scripts
from bench.launchers import LAUNCHERS, Workload, scripts
from bench.report import Figure

OURS_SCRIPT = scripts.GPT_FSDP_RUN
PLAIN_SCRIPT = scripts.GPT_FSDP_PLAIN
GROUP = "fsdp"  # --scenarios fsdp
FAULTS = {  # -> bench.run's scenario
    "fsdp-worker-kill": "worker-kill",
    "fsdp-node-kill": "node-kill",
    "fsdp-scale-up": "scale-up",
    "hsdp-worker-kill": "worker-kill-4",
}
# HSDP, 2 x 2 over four agents: ours only (in place, and the restart path): the plain
# script builds a 1-D mesh whatever it is given
HSDP_ONLY_OURS = {"hsdp-worker-kill"}
THROUGHPUT = "fsdp-throughput"
THROUGHPUT_NO_COPIES = "fsdp-throughput-no-copies"
THROUGHPUT_SAVING = "fsdp-throughput-saving"
SCENARIOS = (THROUGHPUT, THROUGHPUT_NO_COPIES, THROUGHPUT_SAVING, *FAULTS)
CHECKPOINT_INTERVAL = 10
WINDOW = (10, 60)  # steps whose samples/s is the steady state
ARGS = [
    "--epochs=1000",
    "--steps=1000000",
    "--samples=4096",
    "--batch-size=2",
    "--accumulate=1",
    "--workers=1",
    "--threads=1",
    "--seq=64",
    "--vocab=4096",
    "--dim=512",
    "--layers=8",
    "--heads=8",
    "--seed=0",
    "--log-every=1",
    f"--checkpoint-interval={CHECKPOINT_INTERVAL}",
]
THROUGHPUT_ARGS = [
    *(a for a in ARGS if not a.startswith(("--steps=", "--checkpoint-interval="))),
    f"--steps={WINDOW[1] + 10}",
    f"--checkpoint-interval={WINDOW[1] + 10}",  # no save inside the window
]
# the same window with a DCP save every CHECKPOINT_INTERVAL steps in it: ours writes in
# the background, the plain script (as written for torchrun) on the training thread
SAVING_ARGS = [
    *(a for a in ARGS if not a.startswith("--steps=")),
    f"--steps={WINDOW[1] + 10}",
]
# a smaller model for four ranks on two cores (a step of about 0.7 s at 2 x 2)
HSDP_ARGS = [
    *(a for a in ARGS if not a.startswith(("--dim=", "--layers="))),
    "--dim=384",
    "--layers=6",
    "--shard-group-size=2",
]


def train_args(scenario: str) -> list[str]:
    """The flags of ``scenario``'s script."""
    return list(HSDP_ARGS if scenario.startswith("hsdp-") else ARGS)


def runs_under(scenario: str, launcher: str) -> bool:
    """Does ``scenario`` run under ``launcher`` (HSDP: ours only)?"""
    return scenario not in HSDP_ONLY_OURS or launcher.startswith("elasticjob-run")


# (scenario, summary key, metric, target in seconds or None): issue 35's targets
TARGETS = (
    ("fsdp-worker-kill", "seconds", "SIGKILL a worker -> next step", 2.0),
    ("fsdp-worker-kill", "pause", "training paused (last step -> next step)", None),
    ("fsdp-node-kill", "seconds", "SIGKILL an agent (3->2) -> next step", 3.0),
    ("fsdp-node-kill", "pause", "training paused (last step -> next step)", None),
    ("fsdp-scale-up", "seconds", "agent joins (2->3) -> step at 3", None),
    ("fsdp-scale-up", "pause", "training paused (last step -> next step)", 1.5),
    ("hsdp-worker-kill", "seconds", "HSDP 2 x 2: SIGKILL a worker -> next step", None),
    ("hsdp-worker-kill", "pause", "training paused (last step -> next step)", None),
)


def script_for(launcher: str) -> Path | None:
    """The converted script under ours (in place or not), the plain one under torchrun,
    None where no script was written for the launcher."""
    return LAUNCHERS[launcher].script(Workload.GPT_FSDP)


def _baseline_name(launcher: str) -> str:
    if launcher.startswith("elasticjob-run"):
        return "train_gpt_fsdp.py, in place off"
    return f"gpt_fsdp_plain.py, {launcher}"


CASE = f"train_gpt_fsdp.py vs gpt_fsdp_plain.py, steps {WINDOW[0]}-{WINDOW[1]}"
# ours with its shard copies (every 10 steps, run.shard's default), and without them
STEADY = real_scripts.Steady(
    THROUGHPUT, CASE, script_for, tuple(THROUGHPUT_ARGS), WINDOW, 0.98, _baseline_name
)
STEADY_NO_COPIES = real_scripts.Steady(
    THROUGHPUT_NO_COPIES,
    CASE + ", no shard copies",
    script_for,
    tuple(THROUGHPUT_ARGS),
    WINDOW,
    0.98,
    _baseline_name,
    ours_args=("--copy-every=0",),
)
STEADY_SAVING = real_scripts.Steady(
    THROUGHPUT_SAVING,
    CASE + f", a DCP save every {CHECKPOINT_INTERVAL} steps",
    script_for,
    tuple(SAVING_ARGS),
    WINDOW,
    1.0,
    _baseline_name,
)
STEADIES = (STEADY, STEADY_NO_COPIES, STEADY_SAVING)


def expand(scenarios: Iterable[str]) -> list[str]:
    """``--scenarios`` with this group's name replaced by its scenarios."""
    return groups.expand(scenarios, GROUP, SCENARIOS)


def figures(
    summary: dict[str, dict[str, dict[str, Any]]], launchers: Sequence[str]
) -> list[Figure]:
    """Each target's figure, ours in place beside the restart path and each torchrun."""
    return real_scripts.fault_figures(
        summary,
        launchers,
        TARGETS,
        "train_gpt_fsdp.py vs gpt_fsdp_plain.py",
        baseline_name=lambda launcher: (
            "train_gpt_fsdp.py, in place off"
            if launcher.startswith("elasticjob-run")
            else f"gpt_fsdp_plain.py, {launcher}"
        ),
        note_name=lambda launcher: launcher,
    )
