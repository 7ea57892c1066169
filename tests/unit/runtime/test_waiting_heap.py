"""A new worker's heap, grown while it waits for its first group (training/waiting_heap.py).

glibc's settings are process-wide, so everything that grows a heap runs in a process of
its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elasticjob_runtime import contract
from elasticjob_runtime.training.waiting_heap import (
    CEILING,
    Growth,
    ceiling_from_env,
    grow_while,
    growth_limit,
)
from elasticjob_runtime.training.worker_rounds import joins_running_group

MIB = 1 << 20


def test_a_waiting_process_grows_its_heap_by_as_much_again_up_to_the_ceiling() -> None:
    assert growth_limit(134 * MIB) == 134 * MIB
    assert growth_limit(3 * CEILING) == CEILING
    assert growth_limit(134 * MIB, ceiling=64 * MIB) == 64 * MIB
    assert growth_limit(134 * MIB, ceiling=0) == 0


def test_the_ceiling_comes_from_the_environment_and_a_bad_one_says_how_to_fix_it() -> None:
    assert ceiling_from_env({}) == CEILING
    assert ceiling_from_env({contract.WAIT_HEAP_MB: "0"}) == 0
    assert ceiling_from_env({contract.WAIT_HEAP_MB: " 256 "}) == 256 * MIB
    for bad in ("-1", "1.5", "lots"):
        with pytest.raises(ValueError, match=r"ELASTICJOB_WAIT_HEAP_MB=.*whole number.*0 turns"):
            ceiling_from_env({contract.WAIT_HEAP_MB: bad})


def test_without_glibc_or_room_nothing_is_grown_and_nobody_is_asked() -> None:
    asked: list[int] = []

    def waiting() -> bool:
        asked.append(1)
        return True

    assert grow_while(waiting, 100 * MIB, None) == Growth(0, 0.0)
    assert grow_while(waiting, MIB // 2, None) == Growth(0, 0.0)
    assert asked == []


# In a process of its own: grow while the first `answers` questions say "waiting", then
# write 90 MiB of tensors and count the page faults that took.
_GROW_THEN_WRITE = """
import json, resource, sys
import torch
from elasticjob_runtime.training.waiting_heap import GlibcHeap, grow_while
answers, limit_mib, failing = (int(a) for a in sys.argv[1:4])
heap = GlibcHeap.load()
before = heap.size()
asked = []
def waiting():
    asked.append(1)
    if failing and len(asked) > answers:
        raise RuntimeError("the store went away")
    return len(asked) <= answers
growth = grow_while(waiting, limit_mib << 20, heap)
kept = heap.size() - before
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
tensors = [torch.empty(1 << 18).fill_(1.0) for _ in range(90)]
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
print(json.dumps({"grown": growth.grown, "asked": len(asked),
                  "kept": kept, "faults": faults}))
"""


def _grow_then_write(answers: int, limit_mib: int, failing: bool = False) -> dict[str, int]:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _GROW_THEN_WRITE,
            *(str(int(a)) for a in (answers, limit_mib, failing)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout)


def test_the_grown_heap_is_kept_and_a_step_written_into_it_takes_few_page_faults() -> None:
    # the last member to arrive is asked once, grows nothing and leaves glibc as it was
    last = _grow_then_write(answers=0, limit_mib=200)
    assert last["grown"] == 0 and last["asked"] == 1
    assert last["faults"] > 20_000, last  # 90 MiB on new pages: one fault per 4 KiB
    grown = _grow_then_write(answers=120, limit_mib=200)
    assert grown["grown"] == 120 * MIB
    assert grown["asked"] == 121  # before the first chunk and after each
    assert grown["kept"] >= 110 * MIB, grown  # freed, and glibc kept it
    assert grown["faults"] < last["faults"] // 10, (grown, last)


def test_the_growth_stops_at_its_limit_and_when_asking_fails() -> None:
    limited = _grow_then_write(answers=1_000, limit_mib=16)
    assert limited["grown"] == 16 * MIB and limited["asked"] == 17
    failed = _grow_then_write(answers=5, limit_mib=200, failing=True)
    assert failed["grown"] == 5 * MIB and failed["asked"] == 6


def test_a_bad_ceiling_stops_the_script_at_run_and_names_the_fix(tmp_path: Path) -> None:
    script = (
        "from elasticjob_runtime import Run\n"
        f"Run(checkpoint_dir={str(tmp_path / 'ckpt')!r})\n"
        "print('constructed')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, contract.WAIT_HEAP_MB: "lots"},
    )
    assert out.returncode == 1 and "constructed" not in out.stdout
    assert "ELASTICJOB_WAIT_HEAP_MB='lots': give the most MiB" in out.stderr, out.stderr


def test_only_a_process_started_into_a_group_that_trained_before_grows() -> None:
    assert joins_running_group({contract.ROUND_CAUSE: "join"})
    assert joins_running_group({contract.ROUND_CAUSE: "crash"})
    assert not joins_running_group({contract.ROUND_CAUSE: "start"})
    assert not joins_running_group({})  # torch's own rendezvous says no cause
