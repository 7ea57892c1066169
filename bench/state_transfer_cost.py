"""`python -m bench.state_transfer_cost`: what moving the realistic example's state to a
new process costs, with the state's buckets at two sizes.

A survivor hands a joiner (or a worker that replaces a killed one) the whole training
state: the model, AdamW's moments, the EMA, 53 MB at the example's sizes
(``checkpoints/state_broadcast.py``). The group waits for it. This runs that hand-over
alone: two fresh processes over gloo on loopback, the sender after one training step
(so AdamW holds its moments), the receiver as a joiner builds it (AdamW empty), and
``broadcast_state`` from one to the other, ``--reps`` times in the same two processes
(the first is what a new process pays; the later ones what a survivor pays again).
``--busy`` processes compute beside them, for the two cores the other ranks fill. Each
case is a bucket size: 64 MiB (one bucket for this state: the plan before 2026-11-29,
filled whole, then sent) and the default, small buckets pipelined.

Reported per side and repetition: wall time of the move, CPU time, minor page faults;
the receiver's state is checked equal to the sender's after each move.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import side_load
from bench.gpt_state import realistic_state
from bench.launchers.scripts import REPO
from bench.ports import free_port
from bench.report import middle_and_range, write_probe

ONE_BUCKET = 1 << 26  # the bucket size before the pipelined plan


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def side(rank: int, port: int, reps: int, bucket_bytes: int) -> list[dict[str, Any]]:
    """One rank's part: rank 0 sends, rank 1 (a new process, AdamW empty) receives."""
    import torch
    import torch.distributed as dist

    from elasticjob_runtime.checkpoints.state_broadcast import broadcast_state, map_tensors

    torch.set_num_threads(1)
    objects = realistic_state(trained=rank == 0)  # rank 0 a survivor, rank 1 a new process
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cpu = torch.device("cpu")
    rows: list[dict[str, Any]] = []
    for _ in range(reps):
        dist.barrier()
        faults, wall, used = _faults(), time.perf_counter(), time.process_time()
        sent = {k: v.state_dict() for k, v in objects.items()} if rank == 0 else None
        got = broadcast_state(sent, 0, cpu, receivers=[1], bucket_bytes=bucket_bytes)
        if got is not None:
            for key, target in objects.items():
                target.load_state_dict(got[key])
        row: dict[str, Any] = {
            "wall_s": time.perf_counter() - wall,
            "cpu_s": time.process_time() - used,
            "faults": _faults() - faults,
        }
        leaves: list[torch.Tensor] = []
        map_tensors({k: v.state_dict() for k, v in objects.items()}, leaves.append)
        total = sum(float(t.double().sum()) for t in leaves)
        sums = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
        dist.all_gather(sums, torch.tensor([total], dtype=torch.float64))
        row["equal"] = sums[0].item() == sums[1].item()
        rows.append(row)
        del got, sent
    dist.destroy_process_group()
    return rows


def run_case(reps: int, bucket_bytes: int) -> list[list[dict[str, Any]]]:
    """Both sides in processes of their own; their rows, sender first."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import json; from bench.state_transfer_cost import side; "
                f"print(json.dumps(side({rank}, {port}, {reps}, {bucket_bytes})))",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [proc.communicate(timeout=300)[0] for proc in procs]
    for proc in procs:
        if proc.returncode:
            raise SystemExit(f"a side exited {proc.returncode}")
    return [json.loads(out.splitlines()[-1]) for out in outs]


def main(argv: list[str] | None = None) -> None:
    from elasticjob_runtime.checkpoints.state_broadcast import BUCKET_BYTES

    p = argparse.ArgumentParser(prog="python -m bench.state_transfer_cost")
    p.add_argument("--reps", type=int, default=3, help="moves in the same two processes")
    p.add_argument("--cases", type=int, default=3, help="fresh pairs of processes per size")
    p.add_argument("--busy", type=int, default=2, help="processes computing beside them")
    p.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = p.parse_args(argv)
    sizes = {"one 64 MiB bucket": ONE_BUCKET, f"{BUCKET_BYTES >> 20} MiB, pipelined": BUCKET_BYTES}
    seconds = 60 + 40 * args.cases * len(sizes)  # bounded: each stops by itself
    results: dict[str, list[list[list[dict[str, Any]]]]] = {name: [] for name in sizes}
    with side_load.alongside([side_load.training_like(seconds)] * args.busy):
        for _ in range(args.cases):  # the sizes alternate, so drift hits both
            for name, size in sizes.items():
                results[name].append(run_case(args.reps, size))
    print(f"the state moved to a new process, {args.cases} pairs each, beside {args.busy} busy")
    for name, cases in results.items():
        for label, index in (("sender", 0), ("receiver", 1)):
            for when, reps in (("first move", slice(0, 1)), ("later moves", slice(1, None))):
                rows = [row for case in cases for row in case[index][reps]]
                if not rows:
                    continue
                summary = middle_and_range(rows, ("wall_s", "cpu_s", "faults"))
                print(f"  {name:18s} {label:8s} {when:11s} {summary}")
        if not all(row["equal"] for case in cases for row in case[1]):
            raise SystemExit(f"{name}: a receiver's state differs from the sender's")
    if args.out is not None:
        write_probe(args.out, args, {"cases": results})


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
