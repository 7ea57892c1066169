"""The GPU path in one prepared run, for a machine with one NVIDIA GPU lent for minutes.

Every section runs in its own process with its own time limit, in the order that
matters most, and writes its results into ``--out`` as it goes, so a run cut short still
returns what it measured:

1. ``nccl``: NCCL's abort and rebuild, looped, and an abort that frees a blocked
   collective (bench/gpu_nccl.py);
2. ``recovery``: the in-place recovery tests with every worker on ``cuda:0`` (two
   processes share the GPU over gloo): the async save's pinned copy and a restore onto
   the GPU, the realistic script through a worker kill and a join, bitwise against its
   unfaulted run, and FSDP2 through a join (against a DCP reshard) and a worker kill;
3. ``stall``: the checkpoint stall at 1 GB and 10 GB of model + Adam state resident on the
   GPU, beside ``torch.save`` and the link's own copy speed (bench/gpu_stall.py);
4. ``overhead``: the Run's cost on a GPU-bound step of a 135M-parameter GPT in bf16
   (bench/gpu_overhead.py);
5. later additions, each named with ``--only``: ``nccl-monitor-100ms`` (the abort loop
   with torch's NCCL monitor polling every 100 ms) and ``sharded`` (the HSDP join and kill
   tests with all four ranks on ``cuda:0``, and FSDP2 against one process).

``bench/gpu.sh`` installs the carried wheels and runs this; docs/recovery.md ("On a GPU")
has the figures of the last run and what stays unproven.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SHARDED_TESTS = [  # the recovery tests' FSDP2 cases did not cover HSDP or the one-process twin
    "tests/integration/recovery/test_fsdp_in_place.py::"
    "test_fsdp_at_world_2_trains_what_one_process_trains_on_the_same_global_batch",
    "tests/integration/recovery/test_hsdp_in_place.py::"
    "test_an_hsdp_replica_joins_from_memory_and_trains_what_a_dcp_reshard_trains",
    "tests/integration/recovery/test_hsdp_in_place.py::"
    "test_a_killed_hsdp_worker_costs_no_step_and_hsdp_trains_what_one_process_trains",
]
RECOVERY_TESTS = [
    "tests/unit/runtime/test_gpu_state.py",
    "tests/integration/test_run_defaults.py",
    "tests/integration/recovery/test_real_scripts.py::"
    "test_a_realistic_script_through_a_kill_and_a_join_trains_what_an_unfaulted_run_trains",
    "tests/integration/recovery/test_fsdp_in_place.py::"
    "test_an_fsdp_join_moves_the_shards_in_memory_and_trains_what_a_dcp_reshard_trains",
    "tests/integration/recovery/test_fsdp_in_place.py::"
    "test_a_killed_fsdp_worker_goes_back_to_the_shard_copies_or_the_checkpoint_in_place",
]


def sections(out: Path) -> list[tuple[str, list[str], float, dict[str, str]]]:
    """(name, command, its time limit in seconds, extra environment), in running order.
    The limits are what the first run on an H200 needed, with room: about 11 minutes in
    all, so a lease of 15 runs it as two calls (``--only nccl recovery``, then
    ``--only stall overhead``), each under the 10 minutes one call may take."""
    py = sys.executable
    shared = {"ELASTICJOB_DEVICE": "cuda:0"}  # every local rank on the one GPU, over gloo
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=150"]
    stall = [py, "-m", "bench.gpu_stall"]
    return [
        ("nccl", [py, "-m", "bench.gpu_nccl", f"--out={out / 'nccl.json'}"], 120, {}),
        ("recovery", [*pytest, *RECOVERY_TESTS], 360, shared),
        # NCCL's abort took 1.00 s every time: with its monitor polling every 100 ms?
        (
            "nccl-monitor-100ms",
            [py, "-m", "bench.gpu_nccl", "--part=loop", f"--out={out / 'nccl-monitor.json'}"],
            60,
            {"TORCH_NCCL_COORD_CHECK_MILSEC": "100"},
        ),
        ("sharded", [*pytest, *SHARDED_TESTS], 300, shared),  # HSDP: 4 ranks on the one GPU
        ("stall", [*stall, "--sizes=1GB", f"--out={out / 'stall.json'}"], 60, {}),
        (
            "stall-10GB",
            [*stall, "--sizes=10GB", "--no-baseline", f"--out={out / 'stall10.json'}"],
            120,
            {},
        ),
        (
            "overhead",
            [
                py,
                "-m",
                "bench.gpu_overhead",
                "--reps=1",
                "--steps=90",
                f"--out={out / 'overhead.json'}",
            ],
            150,
            {},
        ),
    ]


def environment() -> dict[str, Any]:
    import torch

    found: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        found.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]
    return found


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget", type=float, default=400, help="seconds for all sections")
    p.add_argument("--only", nargs="*", default=None, help="run these sections alone")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    summary: dict[str, Any] = {"environment": environment(), "sections": {}}
    path = args.out / "gpu.json"
    path.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary["environment"]), flush=True)
    for name, cmd, limit, env in sections(args.out):
        if args.only is not None and name not in args.only:
            continue
        left = args.budget - (time.monotonic() - started)
        if left < 20:
            summary["sections"][name] = {"skipped": f"{left:.0f} s of the budget left"}
            continue
        log = args.out / f"{name}.log"
        began = time.monotonic()
        print(f"== {name} (at most {min(limit, left):.0f} s)", flush=True)
        try:
            with log.open("w") as f:
                done = subprocess.run(
                    cmd,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **env},
                    timeout=min(limit, left),
                )
            result: dict[str, Any] = {"exit": done.returncode}
        except subprocess.TimeoutExpired:
            result = {"exit": None, "timed_out": True}
        result["seconds"] = round(time.monotonic() - began, 1)
        summary["sections"][name] = result
        path.write_text(json.dumps(summary, indent=1))
        print(f"   {json.dumps(result)}; last lines:", flush=True)
        print("\n".join(log.read_text(errors="replace").splitlines()[-12:]), flush=True)


if __name__ == "__main__":
    main()
