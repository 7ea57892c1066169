"""The operator's settings, read once from the environment the chart gives it, pure.

Everything a bad value can stop is checked here, before the operator connects to
anything, and stops it with one line naming the variable to fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from elasticjob_operator import gang, network_policy
from elasticjob_operator.etcd import shared as shared_etcd
from elasticjob_operator.reconcile import Config


@dataclass(frozen=True)
class Settings:
    namespaces: tuple[str, ...]  # watched; empty: all
    resync_seconds: float
    # threads that reconcile jobs (each job one at a time; one kept for urgent jobs): how
    # many API requests at once (the chart's reconcileWorkers)
    workers: int
    metrics_port: int
    # loopback unless told otherwise (the chart sets 0.0.0.0 inside the operator's pod)
    metrics_addr: str
    config: Config
    # gang placement by kube-scheduler: auto, true or false (the chart's gangScheduling);
    # whether the cluster serves it is asked at start (assembly.py), which fills config.gang
    gang_mode: gang.Mode = gang.Mode.AUTO


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "")
    try:
        return float(raw) if raw else default
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not a number; set it to seconds, e.g. 10") from None


def _bool(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw not in ("", "true", "false"):
        raise SystemExit(f"{name}={raw!r} is neither true nor false; set it to one of them")
    return raw == "true"


def kueue_enabled(env: Mapping[str, str]) -> bool:
    """The chart's kueue.enabled: jobs in a Kueue queue are admitted by Kueue."""
    return _bool(env, "ELASTICJOB_KUEUE")


def from_env(env: Mapping[str, str]) -> Settings:
    """The settings, or SystemExit with one line saying what to set."""
    workers = int(_float(env, "ELASTICJOB_RECONCILE_WORKERS", 8))
    if workers < 2:
        raise SystemExit(f"ELASTICJOB_RECONCILE_WORKERS={workers}: set it to 2 or more")
    liveness = int(_float(env, "ELASTICJOB_AGENT_LIVENESS_PERIOD_SECONDS", 10))
    if liveness < 1:
        raise SystemExit(
            f"ELASTICJOB_AGENT_LIVENESS_PERIOD_SECONDS={liveness}: set it to 1 second or more"
        )
    try:
        config = Config(
            below_min_grace_seconds=_float(env, "ELASTICJOB_BELOW_MIN_GRACE_SECONDS", 300.0),
            node_lost_grace_seconds=_float(env, "ELASTICJOB_NODE_LOST_GRACE_SECONDS", 10.0),
            agent_liveness_period_seconds=liveness,
            network_policy=network_policy.peer_from_env(env),
            shared_etcd=shared_etcd.from_env(env),
            kueue=kueue_enabled(env),
        )
        gang_mode = gang.mode_from_env(env)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    return Settings(
        namespaces=tuple(n for n in env.get("ELASTICJOB_NAMESPACES", "").split(",") if n.strip()),
        resync_seconds=_float(env, "ELASTICJOB_RESYNC_SECONDS", 10.0),
        workers=workers,
        metrics_port=int(_float(env, "ELASTICJOB_METRICS_PORT", 8000)),
        metrics_addr=env.get("ELASTICJOB_METRICS_ADDR", "127.0.0.1"),
        config=config,
        gang_mode=gang_mode,
    )
