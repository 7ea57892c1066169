"""A tiny elastic training loop for the rendezvous tests (run by the launchers under test).

Every step all-reduces a one over gloo (so the sum is the world size every rank
really sees) and appends one JSON line per rank to ``$RDZV_TEST_OUT/steps.jsonl``.
Rank 0 records the next step in ``$RDZV_TEST_OUT/step`` so a restarted group
resumes where the last one stopped instead of from zero. SIGUSR1 makes a worker
fail the way a collective fails when a peer vanishes: a Python exception, exit 1.
Creating ``$RDZV_TEST_OUT/stop`` ends the job at the next step, so tests finish as
soon as they have seen what they wait for rather than after a fixed step count.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def fail_like_a_broken_collective(signum: int, frame: object) -> None:
    # Exit at once (no slow interpreter teardown) so the agent sees the failure
    # well before the vanished peer's lease runs out.
    print("simulated: all_reduce failed because a peer vanished", file=sys.stderr, flush=True)
    os._exit(1)


def main() -> None:
    signal.signal(signal.SIGUSR1, fail_like_a_broken_collective)
    out = Path(os.environ["RDZV_TEST_OUT"])
    steps = int(os.environ.get("RDZV_TEST_STEPS", "30"))
    pause = float(os.environ.get("RDZV_TEST_PAUSE", "0.2"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    marker = out / "step"
    start = int(marker.read_text()) if marker.exists() else 0
    stop_file = out / "stop"
    for step in range(start, steps):
        # [1, stop?] summed over ranks: the world size every rank sees, and whether the
        # test has asked the job to finish (all ranks leave the loop at the same step).
        flags = torch.tensor([1.0, 1.0 if stop_file.exists() else 0.0])
        dist.all_reduce(flags)
        line = {
            "t": time.time(),
            "rank": rank,
            "world": world,
            "seen": int(flags[0].item()),
            "step": step,
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "agent": os.getppid(),
        }
        with (out / "steps.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")
        if rank == 0:
            tmp = out / f"step.{os.getpid()}"
            tmp.write_text(str(step + 1))
            tmp.replace(marker)
        if flags[1].item() > 0:
            break
        time.sleep(pause)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
