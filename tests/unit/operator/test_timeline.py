"""A job's timeline picture (elasticjob_operator/timeline.py): the series drawn from
``status.goodput``, the PNG, and the command's errors and namespace, without a cluster."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from elasticjob_operator import models, timeline

T0 = datetime(2026, 11, 28, 9, 0, tzinfo=UTC)  # the job's creation


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def mark(
    cause: str, since: float, time: float, pause: float, before: int, step: int, world: int
) -> models.TimelineMark:
    return models.TimelineMark(
        cause=cause,
        since=at(since),
        time=at(time),
        pause_seconds=pause,
        from_step=before,
        step=step,
        world=world,
    )


# Two runs: the first waits 10 s, starts, has a failure and a join (2 -> 3 workers) and is
# suspended at 300 s; the second starts at 400 s from its checkpoint (step 801, below the
# 900 done), and its group restarts at 500 s, going back from 1100 to 1001.
MARKS = [
    mark("start", 10, 30, 20, 0, 1, 2),
    mark("failure", 100, 103, 2.5, 300, 301, 2),
    mark("join", 200, 201, 0.8, 600, 601, 3),
    mark("suspended", 300, 400, 100, 900, 801, 0),
    mark("start", 400, 420, 20, 0, 801, 3),
    mark("restart", 500, 510, 9.0, 1100, 1001, 3),
]


def goodput(marks: list[models.TimelineMark] = MARKS) -> models.Goodput:
    return models.Goodput(
        run_id="uid-1",
        runs=2,
        ratio=0.7083,
        percent="70.8%",
        wall_seconds=600.0,
        training_seconds=425.0,
        waiting_seconds=110.0,
        startup_seconds=40.0,
        paused_seconds={"failure": 2.5, "join": 0.8, "restart": 9.0},
        lost_seconds=8.0,
        checkpoint_seconds=4.7,
        recoveries={"failure": 1, "join": 1, "restart": 1},
        longest_pause_seconds=9.0,
        step=1300,
        through_time=at(600),
        timeline=marks,
    )


def test_the_step_line_is_flat_through_each_pause_and_goes_back_on_a_restart() -> None:
    s = timeline.series(goodput(), "ml/bert")
    assert s.steps == (
        (0.0, 0),
        (10.0, 0),  # waiting for the first run
        (30.0, 0),  # its startup
        (30.0, 1),
        (100.0, 300),  # a failure: flat for its pause
        (103.0, 300),
        (103.0, 301),
        (200.0, 600),  # a join
        (201.0, 600),
        (201.0, 601),
        (300.0, 900),  # suspended, and the next run's startup: one pause at 900 ...
        (400.0, 900),
        (420.0, 900),
        (420.0, 801),  # ... until its first step, from its checkpoint
        (500.0, 1100),  # a restart, back to a checkpoint
        (510.0, 1100),
        (510.0, 1001),
        (600.0, 1300),  # the ledger's last entry
    )
    assert s.end == 600.0


def test_the_world_size_changes_at_each_marks_first_step_and_is_zero_when_suspended() -> None:
    s = timeline.series(goodput(), "ml/bert")
    assert s.world == ((0.0, None), (30.0, 2), (201.0, 3), (300.0, 0), (400.0, None), (420.0, 3))


def test_each_pause_is_a_span_of_its_cause_with_a_color_of_its_own() -> None:
    s = timeline.series(goodput(), "ml/bert")
    assert [(p.kind, p.start, p.end, p.seconds) for p in s.spans] == [
        ("waiting", 0.0, 10.0, 10.0),
        ("startup", 10.0, 30.0, 20.0),
        ("failure", 100.0, 103.0, 2.5),
        ("join", 200.0, 201.0, 0.8),
        ("suspended", 300.0, 400.0, 100.0),
        ("startup", 400.0, 420.0, 20.0),
        ("restart", 500.0, 510.0, 9.0),
    ]
    kinds = {p.kind for p in s.spans}
    assert len({s.colors[k] for k in kinds}) == len(kinds)


def test_a_cause_a_newer_runtime_adds_gets_a_color_no_other_has() -> None:
    marks = [*MARKS, mark("hang", 550, 560, 9.5, 1200, 1201, 3)]
    s = timeline.series(goodput(marks), "ml/bert")
    assert s.spans[-1].kind == "hang"
    assert s.colors["hang"] not in {c for k, c in s.colors.items() if k != "hang"}


def test_the_title_and_legend_give_the_goodput_and_every_bucket() -> None:
    s = timeline.series(goodput(), "ml/bert")
    assert s.title == "ElasticJob ml/bert: goodput 70.8% of 10.0 min in 2 runs, step 1300"
    assert s.legend == (
        ("", "training 7.1 min (70.8%)"),
        ("waiting", "waiting 1.8 min (18.3%)"),
        ("suspended", "  of it suspended 1.7 min"),
        ("startup", "startup 40.0 s (6.7%)"),
        ("failure", "paused, failure: 2.5 s (0.4%), 1 recovery"),
        ("join", "paused, join: 0.8 s (0.1%), 1 recovery"),
        ("restart", "paused, restart: 9.0 s (1.5%), 1 recovery"),
        ("", "lost 8.0 s (1.3%)"),
        ("", "checkpoint 4.7 s (0.8%)"),
        ("", "longest pause 9.0 s"),
    )
    assert all(kind in s.colors for kind, _ in s.legend if kind)


def test_a_run_suspended_before_its_next_first_step_keeps_its_step() -> None:
    resumed = [*MARKS[:3], mark("suspended", 300, 400, 100, 900, 900, 0)]  # no step yet
    s = timeline.series(goodput(resumed).model_copy(update={"step": 900}), "ml/bert")
    assert s.steps[-3:] == ((300.0, 900), (400.0, 900), (600.0, 900))
    assert s.world[-2:] == ((300.0, 0), (400.0, None))


def test_a_job_with_no_marks_yet_is_a_line_from_its_start() -> None:
    s = timeline.series(goodput([]), "ml/bert")
    assert s.steps == ((0.0, 0), (600.0, 1300))
    assert s.world == ((0.0, None),)
    assert s.spans == ()


def test_the_picture_is_a_png(tmp_path: Path) -> None:
    path = timeline.draw(timeline.series(goodput(), "ml/bert"), tmp_path / "a" / "bert.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000


def test_a_job_without_goodput_says_what_to_wait_for(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    job: dict[str, Any] = {"metadata": {"name": "bert", "namespace": "ml"}, "status": {}}
    monkeypatch.setattr(timeline, "read_job", lambda *args: job)
    assert timeline.main(["bert", "-n", "ml", "-o", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err
    assert "elasticjob ml/bert has no status.goodput yet" in err
    assert "first training step" in err
    assert not (tmp_path / "x.png").exists()


def test_the_command_writes_the_picture_and_prints_its_path(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    job = {
        "metadata": {"name": "bert", "namespace": "ml"},
        "status": {"goodput": goodput().model_dump(mode="json")},
    }
    monkeypatch.setattr(timeline, "read_job", lambda *args: job)
    monkeypatch.chdir(tmp_path)
    assert timeline.main(["bert"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "bert-timeline.png")
    assert (tmp_path / "bert-timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_the_arguments_are_kubectls() -> None:
    p = timeline.parser("kubectl elasticjob-timeline")
    args = p.parse_args(["bert", "--namespace=ml", "--context", "prod", "--kubeconfig", "k"])
    assert (args.job, args.namespace, args.context, args.kubeconfig) == ("bert", "ml", "prod", "k")
    assert p.parse_args(["-nml", "bert"]).namespace == "ml"
    assert p.parse_args(["bert"]).namespace is None


CONTEXTS = [
    {"name": "dev", "context": {"cluster": "c", "user": "u", "namespace": "team"}},
    {"name": "prod", "context": {"cluster": "c", "user": "u"}},
]


def test_the_namespace_is_the_contexts_as_kubectl_takes_it() -> None:
    assert timeline.context_namespace(CONTEXTS, "dev", None) == "team"
    assert timeline.context_namespace(CONTEXTS, "dev", "prod") == "default"
    with pytest.raises(timeline.TimelineError, match="no context 'qa'"):
        timeline.context_namespace(CONTEXTS, "dev", "qa")


KUBECONFIG = """
apiVersion: v1
kind: Config
clusters:
- name: c
  cluster: {server: "https://127.0.0.1:1", insecure-skip-tls-verify: true}
users:
- name: u
  user: {token: t}
contexts:
- name: dev
  context: {cluster: c, user: u, namespace: team}
- name: prod
  context: {cluster: c, user: u}
current-context: dev
"""


@pytest.mark.parametrize(
    ("flags", "namespace"),
    [([], "team"), (["--context", "prod"], "default"), (["-n", "ml", "--context", "prod"], "ml")],
)
def test_the_job_is_looked_for_in_the_kubeconfigs_namespace(
    flags: list[str], namespace: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(KUBECONFIG)
    # nothing listens there: the command says which job it could not read
    assert timeline.main(["bert", "--kubeconfig", str(kubeconfig), *flags]) == 1
    err = capsys.readouterr().err
    assert f"reading elasticjob {namespace}/bert: no answer from the API server" in err


def test_without_matplotlib_the_command_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    with pytest.raises(timeline.TimelineError, match=r"pip install 'elasticjob\[timeline\]'"):
        timeline.draw(timeline.series(goodput(), "ml/bert"), tmp_path / "x.png")


def test_the_module_imports_without_matplotlib_or_the_kubernetes_client() -> None:
    """The operator's image has no matplotlib: importing the module needs neither."""
    code = (
        "import sys, elasticjob_operator.timeline; "
        "print(sorted({'matplotlib', 'kubernetes'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
