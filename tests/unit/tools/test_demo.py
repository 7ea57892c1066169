"""The demo's summary figures, computed from worker log lines (scripts/demo.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

DEMO = Path(__file__).resolve().parents[3] / "scripts" / "demo.py"


@pytest.fixture(scope="module")
def demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("elasticjob_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["elasticjob_demo"] = module
    spec.loader.exec_module(module)
    return module


LOG = [
    "starting fresh world=2 rank=0 restarts=0 startup=3.1s t=100.0",
    "step=50 epoch=0 loss=0.5000 world=2 rank=0 restarts=0 samples=3200 pid=1 t=105.0",
    "step=60 epoch=0 loss=0.4000 world=2 rank=0 restarts=0 samples=3840 pid=1 t=106.0",
    # the fault lands at t=106.5; the old round still logs one step while it winds down
    "step=70 epoch=0 loss=0.3900 world=2 rank=0 restarts=0 samples=4480 pid=1 t=107.0",
    "resumed from step 50 (/checkpoints/step-50.pt) world=1 rank=0 restarts=1 t=112.0",
    "step=60 epoch=0 loss=0.4100 world=1 rank=0 restarts=1 samples=3840 pid=2 t=113.0",
    "step=70 epoch=0 loss=0.3800 world=1 rank=0 restarts=1 samples=4160 pid=2 t=114.0",
    "step=80 epoch=0 loss=0.3700 world=1 rank=0 restarts=1 samples=4480 pid=2 t=115.0",
]


def test_pause_runs_from_the_old_rounds_last_step_to_the_new_rounds_first_step_past_it(
    demo: ModuleType,
) -> None:
    r = demo.recovery(LOG, injected_at=106.5, at_step=70)
    assert r is not None
    assert r.paused_for == pytest.approx(115.0 - 107.0)
    assert (r.resumed_from, r.world) == (50, 1)


def test_no_recovery_until_a_new_round_has_passed_the_faults_step(demo: ModuleType) -> None:
    assert demo.recovery(LOG[:5], injected_at=106.5, at_step=70) is None
    assert demo.recovery(LOG[:4], injected_at=106.5, at_step=70) is None


def test_result_line_is_parsed_and_other_lines_are_not(demo: ModuleType) -> None:
    assert demo.parse_result('ELASTICJOB_RESULT {"final_loss": 0.1}') == {"final_loss": 0.1}
    assert demo.parse_result("step=1 loss=2") is None


def test_a_lost_pod_reports_both_pauses_until_the_world_is_whole_again(
    demo: ModuleType,
) -> None:
    rejoined = [
        *LOG,
        "step=90 epoch=0 loss=0.3600 world=1 rank=0 restarts=1 samples=4800 pid=2 t=116.0",
        # the replacement pod joins: the group restarts at world size 2
        "resumed from step 90 (/dev/shm/x) world=2 rank=0 restarts=1 t=117.5",
        "step=91 epoch=0 loss=0.3500 world=2 rank=0 restarts=1 samples=4864 pid=3 t=117.6",
    ]
    assert demo.recoveries(LOG, 106.5, 70, world=2) is None  # still at world size 1
    first, second = demo.recoveries(rejoined, 106.5, 70, world=2)
    assert (first.world, second.world) == (1, 2)
    assert second.paused_for == pytest.approx(117.6 - 116.0)
    assert demo.describe([first, second]).endswith("; then 1.6s -> world size 2")
    assert demo.recoveries(rejoined, 106.5, 70, world=1) == [first]


class FakeDemo:
    """A demo whose job is ``job`` (only draw_timeline's one call)."""

    def __init__(self, job: dict[str, object]) -> None:
        self.reads = 0
        self._job = job

    def job(self) -> dict[str, object]:
        self.reads += 1
        return self._job


GOODPUT = {
    "runId": "uid-1",
    "ratio": 0.9,
    "percent": "90.0%",
    "wallSeconds": 100.0,
    "trainingSeconds": 90.0,
    "waitingSeconds": 4.0,
    "startupSeconds": 5.0,
    "pausedSeconds": {"failure": 1.0},
    "lostSeconds": 0.0,
    "checkpointSeconds": 0.0,
    "recoveries": {"failure": 1},
    "longestPauseSeconds": 1.0,
    "step": 700,
    "throughTime": "2026-11-28T09:01:40Z",
    "timeline": [
        {"cause": "start", "since": "2026-11-28T09:00:04Z", "time": "2026-11-28T09:00:09Z",
         "pauseSeconds": 5.0, "fromStep": 0, "step": 1, "world": 2},
        {"cause": "failure", "since": "2026-11-28T09:00:30Z", "time": "2026-11-28T09:00:31Z",
         "pauseSeconds": 1.0, "fromStep": 200, "step": 201, "world": 2},
    ],
}  # fmt: skip


def test_the_demo_ends_with_a_picture_of_its_job(demo: ModuleType, tmp_path: Path) -> None:
    job = {"metadata": {"name": "demo", "namespace": "demo"}, "status": {"goodput": GOODPUT}}
    path = demo.draw_timeline(FakeDemo(job), tmp_path / "demo-timeline.png")
    assert path == (tmp_path / "demo-timeline.png").resolve()
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_a_demo_job_without_goodput_is_not_drawn(demo: ModuleType, tmp_path: Path) -> None:
    fake = FakeDemo({"metadata": {"name": "demo", "namespace": "demo"}, "status": {}})
    with pytest.raises(demo.timeline.TimelineError, match=r"no status\.goodput yet"):
        demo.draw_timeline(fake, tmp_path / "demo-timeline.png", timeout=-1)
    assert fake.reads == 1
    assert not (tmp_path / "demo-timeline.png").exists()


def test_the_summary_says_the_goodput_and_where_the_rest_went(demo: ModuleType) -> None:
    line = demo.goodput_line(GOODPUT)
    assert line.startswith(f"goodput:          {GOODPUT['percent']} of ")
    assert "paused failure 1.0s" in line and "startup 5.0s" in line
