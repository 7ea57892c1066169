"""elasticjob-run's decisions before anything starts, and the agent's fault attribution."""

from __future__ import annotations

import re

import pytest

from elasticjob_runtime.launch.launcher import (
    config_problem,
    env_switch,
    known_backends,
    parse_nnodes,
    parser,
    progress_endpoint,
    spare_count_option,
    warm_import_list,
)


def args_for(*argv: str) -> object:
    return parser().parse_args([*argv, "train.py"])


@pytest.mark.parametrize(("text", "expected"), [("2", (2, 2)), ("1:4", (1, 4)), (" 3:3 ", (3, 3))])
def test_node_counts_parse_like_torchrun(text: str, expected: tuple[int, int]) -> None:
    assert parse_nnodes(text) == expected


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("3:2", "min (3) is greater than max (2)"),
        ("0:2", "the minimum must be at least 1"),
        ("two", "is not a node count"),
        ("1:2:3", "is not a node count"),
    ],
)
def test_bad_node_counts_say_what_to_fix(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)) as err:
        parse_nnodes(text)
    assert "MIN:MAX" in str(err.value)


def test_the_backend_defaults_to_etcd_v3_and_torchrun_options_still_parse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PET_RDZV_BACKEND", raising=False)
    args = args_for("--nnodes=1:2", "--rdzv-endpoint=127.0.0.1:2379", "--rdzv-id=job")
    assert args.rdzv_backend == "etcd-v3"  # type: ignore[attr-defined]
    assert config_problem(args, known_backends()) is None  # type: ignore[arg-type]


def test_the_injected_backend_variable_is_read_and_a_flag_beats_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")
    assert args_for().rdzv_backend == "c10d"  # type: ignore[attr-defined]
    assert args_for("--rdzv-backend=etcd-v3").rdzv_backend == "etcd-v3"  # type: ignore[attr-defined]


def test_the_monitor_interval_defaults_to_half_a_second_unless_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PET_MONITOR_INTERVAL", raising=False)
    assert args_for().monitor_interval == 0.5  # type: ignore[attr-defined]
    assert args_for("--monitor-interval=0.1").monitor_interval == 0.1  # type: ignore[attr-defined]
    monkeypatch.setenv("PET_MONITOR_INTERVAL", "2")
    assert float(args_for().monitor_interval) == 2.0  # type: ignore[attr-defined]


def test_a_bad_desired_node_count_is_one_line_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PET_RDZV_BACKEND", raising=False)
    args = args_for("--nnodes=1:2", "--rdzv-endpoint=127.0.0.1:2379", "--rdzv-id=job")
    monkeypatch.setenv("ELASTICJOB_DESIRED_NODES", "two")
    problem = config_problem(args, known_backends())  # type: ignore[arg-type]
    assert problem is not None and problem.startswith("ELASTICJOB_DESIRED_NODES='two': ")
    assert "\n" not in problem
    monkeypatch.setenv("ELASTICJOB_DESIRED_NODES", "2")
    assert config_problem(args, known_backends()) is None  # type: ignore[arg-type]


def test_missing_endpoint_or_run_id_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PET_RDZV_ENDPOINT", "PET_RDZV_ID", "PET_RDZV_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    no_endpoint = config_problem(args_for("--rdzv-id=job"), known_backends())  # type: ignore[arg-type]
    assert no_endpoint is not None and "PET_RDZV_ENDPOINT" in no_endpoint
    no_id = config_problem(args_for("--rdzv-endpoint=e:2379"), known_backends())  # type: ignore[arg-type]
    assert no_id is not None and "PET_RDZV_ID" in no_id


def test_workers_publish_progress_to_the_etcd_the_flags_name_never_a_c10d_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "worker-0:29400")
    assert progress_endpoint(args_for()) is None  # type: ignore[arg-type]
    flags = args_for("--rdzv-backend=etcd-v3", "--rdzv-endpoint=etcd-a:2379,etcd-b:2379")
    assert progress_endpoint(flags) == "etcd-a:2379,etcd-b:2379"  # type: ignore[arg-type]
    assert progress_endpoint(args_for("--rdzv-backend=etcd", "--rdzv-endpoint=e")) == "e"  # type: ignore[arg-type]
    assert progress_endpoint(args_for("--standalone")) is None  # type: ignore[arg-type]


def test_the_etcd_v3_entry_point_is_installed() -> None:
    assert "etcd-v3" in known_backends()


def test_launcher_switch_and_warm_import_errors_name_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ELASTICJOB_WARM_SPARES", "off")
    assert env_switch("ELASTICJOB_WARM_SPARES", True) is False
    monkeypatch.setenv("ELASTICJOB_WARM_SPARES", "maybe")
    with pytest.raises(ValueError, match="ELASTICJOB_WARM_SPARES='maybe': use 1 or 0"):
        env_switch("ELASTICJOB_WARM_SPARES", True)
    assert warm_import_list(" numpy, pkg.models ,") == ("numpy", "pkg.models")
    with pytest.raises(ValueError, match="'pkg/models' is not a module name"):
        warm_import_list("pkg/models")


def test_the_spare_count_is_a_number_of_processes_or_unset() -> None:
    assert spare_count_option("") is None  # one per local rank, as before the option
    assert spare_count_option(" 1 ") == 1
    assert spare_count_option("0") == 0
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(ValueError, match="ELASTICJOB_WARM_SPARE_COUNT\\): give the number"):
            spare_count_option(bad)
    assert args_for("--warm-spare-count=1").warm_spare_count == "1"  # type: ignore[attr-defined]


def test_spares_are_forked_from_the_template_unless_the_flag_or_its_variable_says_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert args_for().warm_spare_fork is True  # type: ignore[attr-defined]
    assert args_for("--no-warm-spare-fork").warm_spare_fork is False  # type: ignore[attr-defined]
    monkeypatch.setenv("ELASTICJOB_WARM_SPARE_FORK", "0")
    assert args_for().warm_spare_fork is False  # type: ignore[attr-defined]
    assert args_for("--warm-spare-fork").warm_spare_fork is True  # type: ignore[attr-defined]


def test_a_signal_stop_exits_128_plus_the_signal_and_a_second_sigterm_cannot_change_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Python's exit puts SIGTERM back to its default action; a kubelet's SIGTERM that
    lands there (after a departure that went by its mark) would end us by the signal."""
    import signal

    from torch.distributed.elastic.multiprocessing import SignalException

    from elasticjob_runtime.launch import launcher

    def stopped(*_: object) -> None:
        raise SignalException("got SIGTERM", sigval=signal.SIGTERM)

    for name in ("PET_RDZV_BACKEND", "ELASTICJOB_HEALTH_PORT", "ELASTICJOB_POD_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launcher, "_launch", stopped)
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as exited:
            launcher.main(["--rdzv-endpoint=127.0.0.1:2379", "--rdzv-id=job", "train.py"])
        assert exited.value.code == 143
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)
