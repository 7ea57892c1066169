"""`python -m bench.fingerprint_cost`: what fingerprinting the realistic example's state
costs, with the runtime's bit sum beside torch's widening sum.

The Run compares every rank's fingerprint of the training state at the first step after
each regroup (a join, a kill, a restore) and every ``check_every`` steps
(``training/fingerprint.py``). At the first step after a regroup that is on the group's
time. A fingerprint is one exact integer sum per tensor; torch's own widening sum (an
int32 reading summed into int64) was measured slow for tensors of a million elements
and more on this machine, so the runtime sums those through numpy. This times both on
the same state in one process, alternating, with ``--busy`` processes computing beside
it for the cores the other ranks fill, and checks the two give the same fingerprints.
Two states: the realistic example's (its largest tensor is 147,456 elements, where the
two sums cost the same) and one embedding of a larger model (32,000 x 512).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench import side_load
from bench.gpt_state import realistic_state
from bench.report import write_probe


def torch_bit_sum(tensor: Any) -> Any:
    """The bit sum as torch's widening sum computes it (the runtime's before 2026-11-30)."""
    import torch

    t = tensor.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width).sum(dtype=torch.int64).reshape(1)


def time_both(state: dict[str, Any], reps: int) -> dict[str, Any]:
    """Each sum's fingerprints of ``state`` and its wall times, ``reps`` each, alternating."""
    from elasticjob_runtime.training import fingerprint as fp

    runtime_sum = fp.bit_sum
    sums = {"runtime": runtime_sum, "torch widening": torch_bit_sum}
    times: dict[str, list[float]] = {name: [] for name in sums}
    prints: dict[str, list[int]] = {}
    try:
        for _ in range(reps):
            for name, bit_sum in sums.items():
                fp.bit_sum = bit_sum  # tensor_fingerprint looks it up by name
                start = time.perf_counter()
                prints[name] = [fp.fingerprint(obj) for obj in state.values()]
                times[name].append(time.perf_counter() - start)
    finally:
        fp.bit_sum = runtime_sum
    return {"times_s": times, "same_fingerprints": prints["runtime"] == prints["torch widening"]}


def states() -> dict[str, dict[str, Any]]:
    import torch

    torch.manual_seed(0)
    return {
        "the realistic example (53 MB)": realistic_state(trained=True),
        "an embedding 32000 x 512 (66 MB)": {"embedding": torch.randn(32000, 512)},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.fingerprint_cost")
    p.add_argument("--reps", type=int, default=9, help="fingerprints of the state per sum")
    p.add_argument("--busy", type=int, default=2, help="processes computing beside it")
    p.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    with side_load.alongside([side_load.training_like(60 + 10 * args.reps)] * args.busy):
        for name, state in states().items():
            results[name] = time_both(state, args.reps)
    print(f"fingerprints, {args.reps} per sum and state, beside {args.busy} busy processes:")
    for name, result in results.items():
        for sum_name, times in result["times_s"].items():
            ms = sorted(t * 1000 for t in times)
            print(
                f"  {name:34s} {sum_name:15s} median {statistics.median(ms):7.1f} ms "
                f"({ms[0]:.1f}-{ms[-1]:.1f})"
            )
        if not result["same_fingerprints"]:
            raise SystemExit(f"{name}: the two sums gave different fingerprints")
    if args.out is not None:
        write_probe(args.out, args, {"states": results})


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
