"""``elasticjob-run``: torchrun with the operator's defaults and one-line errors.

It is torchrun itself (same parser, same ``PET_*`` variables, flags win over the
environment, torch's ``LocalElasticAgent`` runs the workers), with these changes:

* the rendezvous backend defaults to ``etcd-v3`` (``PET_RDZV_BACKEND`` still wins);
* the pod IP the operator injects is the default ``--local-addr``;
* bad configuration (a node range with min > max, an unknown backend, an etcd that
  does not answer) stops before anything starts, with one line saying what to fix;
* with etcd-v3, workers that fail because a peer left do not use up ``--max-restarts``
  (:mod:`elasticjob_runtime.launch.agent`);
* workers start from warm spares, interpreters that have already imported torch and
  the script's imports (:mod:`elasticjob_runtime.launch.spare`); ``--no-warm-spares`` (or
  ``ELASTICJOB_WARM_SPARES=0``) starts every worker cold as torchrun does,
  ``--warm-spare-count N`` (``ELASTICJOB_WARM_SPARE_COUNT``) keeps fewer than one per
  local rank (each costs memory, docs/recovery.md), ``--no-warm-spare-fork``
  (``ELASTICJOB_WARM_SPARE_FORK=0``) starts each spare as an interpreter of its own
  instead of forking it from a warm template (:mod:`elasticjob_runtime.launch.spare_template`),
  and ``--warm-import mod,...`` names more modules for the spares to import;
* the workers learn the etcd it rendezvouses on (``ELASTICJOB_PROGRESS_ENDPOINT``),
  where they publish progress (:mod:`elasticjob_runtime.etcd.progress`);
* with ``--hang-timeout S`` (or ``ELASTICJOB_HANG_TIMEOUT``), a group that completes no
  training step for S seconds is restarted (:mod:`elasticjob_runtime.launch.hang`);
* in a pod (or with ``ELASTICJOB_HEALTH_PORT``) it serves the pod's liveness and
  readiness probes, ``/healthz`` and ``/readyz`` (:mod:`elasticjob_runtime.launch.health`);
* once its workers have succeeded it removes their node-memory checkpoint copy
  (``/dev/shm/elasticjob/<job>/<pod>``): outside a pod nothing else ever would. A failure
  or a restart keeps it, since a restart resumes from it;
* a node that comes to a run whose training already finished (a late scale-up pod, or the
  same command run again) exits 0 with one warning saying so and how to start afresh;
* SIGTERM is its own, not torch's: while a round trains, the node announces its
  departure and hands its place over, so its peers lose no step
  (:mod:`elasticjob_runtime.rendezvous.departure`); at any other moment it stops as
  torchrun would. Either way it exits 143, never 0 (a stopped node is not a success).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, NoReturn

from elasticjob_runtime import contract
from elasticjob_runtime.launch import hang, health
from elasticjob_runtime.rendezvous.membership import desired_nodes

if TYPE_CHECKING:  # it imports torch, which a bad command line need not wait for
    from elasticjob_runtime.launch.departing import DepartureRequest

PROG = "elasticjob-run"
# The agent's monitor interval unless asked: what needs it at once wakes it anyway
# (monitor_wake.py), and torch's 0.1 s cost each agent about 4 ms of CPU a second.
MONITOR_INTERVAL_S = 0.5
# by name, not __name__: run as `python -m elasticjob_runtime.launch.launcher` this is __main__
log = logging.getLogger("elasticjob_runtime.launch.launcher")
# torch's own backends; entry-point backends (ours included) are discovered.
BUILTIN_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")


def known_backends() -> list[str]:
    found = {ep.name for ep in entry_points(group="torchrun.handlers")}
    return sorted(set(BUILTIN_BACKENDS) | set(contract.RDZV_BACKENDS) | found)


def parse_nnodes(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` -> (min, max); ValueError with a fix-it message otherwise."""
    parts = text.strip().split(":")
    hint = "use --nnodes N or --nnodes MIN:MAX (or PET_NNODES) with 1 <= MIN <= MAX"
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--nnodes={text!r} is not a node count; {hint}")
    lo, hi = int(parts[0]), int(parts[-1])
    if lo < 1:
        raise ValueError(f"--nnodes={text}: the minimum must be at least 1; {hint}")
    if lo > hi:
        raise ValueError(f"--nnodes={text}: min ({lo}) is greater than max ({hi}); {hint}")
    return lo, hi


def config_problem(args: argparse.Namespace, backends: Sequence[str]) -> str | None:
    """The first thing wrong with the parsed options, as one line, or None."""
    try:
        parse_nnodes(args.nnodes)
    except ValueError as exc:
        return str(exc)
    if args.standalone:
        return None
    if args.rdzv_backend not in backends:
        return (
            f"unknown rendezvous backend {args.rdzv_backend!r} (--rdzv-backend / "
            f"{contract.RDZV_BACKEND}); choose one of: {', '.join(backends)}"
        )
    if args.max_restarts < 0:
        return f"--max-restarts={args.max_restarts}: must be 0 or more"
    if args.rdzv_backend != "static":
        if not args.rdzv_endpoint:
            return (
                f"the {args.rdzv_backend} rendezvous needs an endpoint; pass --rdzv-endpoint "
                f"host:port or set {contract.RDZV_ENDPOINT}"
            )
        if args.rdzv_id in ("", "none"):
            return (
                f"the {args.rdzv_backend} rendezvous needs a run id; pass --rdzv-id or set "
                f"{contract.RDZV_ID} (unique per job run)"
            )
    if args.rdzv_backend == contract.DEFAULT_RDZV_BACKEND:
        try:
            desired_nodes(os.environ)  # the handler reads it, past torch's launcher
        except ValueError as exc:
            return str(exc)
    return None


def progress_endpoint(args: argparse.Namespace) -> str | None:
    """The etcd the workers publish progress to: the one this agent rendezvouses on, if
    its rendezvous is an etcd. Flags win over the environment, so only we know it."""
    if args.standalone or args.rdzv_backend not in contract.ETCD_RDZV_BACKENDS:
        return None
    return str(args.rdzv_endpoint)


def env_switch(name: str, default: bool) -> bool:
    """A yes/no environment variable; ValueError naming the variable otherwise."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: use 1 or 0 (true/false, on/off)")


def spare_count_option(text: str) -> int | None:
    """``--warm-spare-count``: spares kept per node; None (unset) keeps one per local rank."""
    raw = text.strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(
            f"--warm-spare-count={text!r} (or {contract.WARM_SPARE_COUNT}): give the number "
            "of warm spares to keep per node, 0 or more (unset: one per local rank)"
        )
    return int(raw)


def warm_import_list(text: str) -> tuple[str, ...]:
    """``mod,pkg.mod`` -> module names; ValueError naming a bad one."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(
                f"--warm-import: {name!r} is not a module name; give dotted module names "
                "separated by commas, e.g. --warm-import numpy,mypkg.models"
            )
    return names


def _fail(message: str, code: int = 2) -> NoReturn:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


# In a pod the operator started, the job's own etcd is created at the same moment as the
# workers and may answer a little later (image pull, start, Service routing): wait for it.
ETCD_WAIT_IN_POD_SECONDS = 120.0


def _check_etcd(endpoint: str, conf: str = "", wait_seconds: float = 0.0) -> None:
    from elasticjob_runtime.etcd.client import EtcdError, EtcdTLSError
    from elasticjob_runtime.etcd.tls import connect, parse_conf

    try:
        client = connect(endpoint, parse_conf(conf), timeout=5)
    except (ValueError, EtcdError) as exc:
        _fail(str(exc))
        return
    deadline = time.monotonic() + wait_seconds
    said = False
    try:
        while True:
            try:
                client.check()
                return
            except EtcdError as exc:
                # a TLS setting that is wrong stays wrong: no point waiting for it
                if isinstance(exc, EtcdTLSError) or time.monotonic() >= deadline:
                    _fail(str(exc))
                if not said:
                    print(f"{PROG}: waiting up to {wait_seconds:.0f}s: {exc}", file=sys.stderr)
                    said = True
                time.sleep(1.0)
    finally:
        client.close()


def _share_etcd_tls(endpoint: str, conf: str) -> None:
    """Tell the workers (progress, node-memory reports) the TLS files the rendezvous uses
    when ``--rdzv-conf`` names them: they read only the environment."""
    from elasticjob_runtime.etcd.tls import parse_conf, tls_environ, tls_settings

    try:
        os.environ.update(tls_environ(tls_settings(endpoint, parse_conf(conf))))
    except ValueError as exc:
        _fail(str(exc))


def parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    p = get_args_parser()
    p.prog = PROG
    p.description = "Elastic, fault-tolerant PyTorch launcher (torchrun-compatible)."
    p.set_defaults(
        rdzv_backend=os.environ.get(contract.RDZV_BACKEND, contract.DEFAULT_RDZV_BACKEND)
    )
    if os.environ.get(contract.POD_IP) and not os.environ.get("PET_LOCAL_ADDR"):
        p.set_defaults(local_addr=os.environ[contract.POD_IP])
    if not os.environ.get("PET_MONITOR_INTERVAL"):  # torchrun's variable for the flag
        p.set_defaults(monitor_interval=MONITOR_INTERVAL_S)
    for action in p._actions:
        if action.dest == "monitor_interval":
            action.help = (
                "seconds between the agent's looks at its workers when nothing happens "
                f"(default {MONITOR_INTERVAL_S}, torchrun's 0.1): a worker's exit, its "
                "requests and a membership change start one at once (monitor_wake.py)"
            )
    try:
        warm = env_switch(contract.WARM_SPARES, True)
        fork = env_switch(contract.WARM_SPARE_FORK, True)
    except ValueError as exc:
        _fail(str(exc))
    p.add_argument(
        "--warm-spares",
        action=argparse.BooleanOptionalAction,
        default=warm,
        help="start workers from warm spare processes that have already imported torch and "
        f"the script's imports (default on; env {contract.WARM_SPARES}=0 turns it off)",
    )
    p.add_argument(
        "--warm-spare-count",
        default=os.environ.get(contract.WARM_SPARE_COUNT, ""),
        help="how many warm spares this node keeps, at most one per local rank (default one "
        "per local rank); each is a process with torch imported (forked from one template: a "
        "few MiB each beside its 360 MiB; without --warm-spare-fork, about 360 MiB each), "
        f"and a restart waits for any rank that starts cold (env {contract.WARM_SPARE_COUNT})",
    )
    p.add_argument(
        "--warm-spare-fork",
        action=argparse.BooleanOptionalAction,
        default=fork,
        help="fork spares from one warm template process, so replacing a spare that a "
        "restart took imports nothing on the cores the training uses (default on; env "
        f"{contract.WARM_SPARE_FORK}=0 starts each spare as an interpreter of its own)",
    )
    p.add_argument(
        "--warm-import",
        default=os.environ.get(contract.WARM_IMPORT, ""),
        help="comma-separated modules the warm spares import besides the script's own "
        f"top-level imports (env {contract.WARM_IMPORT})",
    )
    p.add_argument(
        "--hang-timeout",
        default=os.environ.get(contract.HANG_TIMEOUT, ""),
        help="restart the worker group when its workers complete no training step "
        "(CheckpointManager.mark_step) for this many seconds, counted from the first step "
        f"of each round; costs a restart (env {contract.HANG_TIMEOUT}; default off)",
    )
    return p


def _show_runtime_logs() -> None:
    """Membership decisions (who left, who joined, why a restart) are worth seeing by default."""
    runtime = logging.getLogger("elasticjob_runtime")
    if not runtime.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(name)s: %(message)s"))
        runtime.addHandler(handler)
        runtime.setLevel(os.environ.get("LOGLEVEL", "INFO").upper())
        runtime.propagate = False


def main(argv: Sequence[str] | None = None) -> None:
    _show_runtime_logs()
    args = parser().parse_args(list(argv) if argv is not None else None)
    problem = config_problem(args, known_backends())
    if problem:
        _fail(problem)
    try:
        warm_imports = warm_import_list(args.warm_import)
        spare_count = spare_count_option(str(args.warm_spare_count))
        hang_timeout = hang.parse_timeout(
            str(args.hang_timeout), f"--hang-timeout (or {contract.HANG_TIMEOUT})"
        )
    except ValueError as exc:
        _fail(str(exc))
    from torch.distributed.elastic.multiprocessing import SignalException

    from elasticjob_runtime.launch.departing import DepartureRequest

    departure = DepartureRequest()
    signal.signal(signal.SIGTERM, functools.partial(_on_sigterm, departure))
    joined = threading.Event()  # the agent sets it once its workers first run in a round
    probes = _serve_probes(joined)
    try:
        _launch(args, warm_imports, joined, hang_timeout, spare_count, departure)
    except SignalException as exc:
        # The stop is under way. Python's exit puts SIGTERM back to its default action, so
        # a second SIGTERM now (the kubelet's, after a departure that went by its mark)
        # would end us by the signal instead of with the status we chose.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # torch's launcher does not shut the rendezvous down after a signal; the node
        # still leaves now, while this exception's frames keep its handler alive.
        from elasticjob_runtime.rendezvous.handler import leave_registered

        leave_registered()
        log.info("stopped by %s", signal.Signals(exc.sigval).name)
        raise SystemExit(128 + int(exc.sigval)) from None
    finally:
        if probes is not None:
            probes.stop()


def _on_sigterm(departure: DepartureRequest, signum: int, _frame: object) -> None:
    """A departure while a round trains (the agent carries it out); otherwise stop now,
    as torch's own handler would (its agent stops the workers and re-raises)."""
    from elasticjob_runtime.launch.departing import stop_signal

    if not departure.take():
        raise stop_signal(signal.Signals(signum))


def _serve_probes(joined: threading.Event) -> health.HealthServer | None:
    """The pod's probes, answering from now on (also while we wait for etcd below)."""
    if not health.health_wanted(os.environ):
        return None
    try:
        host, port = health.health_address(os.environ)
    except ValueError as exc:
        _fail(str(exc))
    try:
        server = health.HealthServer(host, port, ready=joined.is_set).start()
    except OSError as exc:
        _fail(
            f"cannot serve health probes on {host}:{port} ({exc.strerror or exc}); set "
            f"{contract.HEALTH_PORT} to a free port"
        )
    log.info("probes at %s/healthz and %s/readyz", server.url, server.url)
    return server


def _launch(
    args: argparse.Namespace,
    warm_imports: tuple[str, ...],
    joined: threading.Event,
    hang_timeout: float | None = None,
    spare_count: int | None = None,
    departure: DepartureRequest | None = None,
) -> None:
    """Check the etcd, then run torchrun's launch with our agent until the job ends."""
    if not args.standalone and args.rdzv_backend == "etcd-v3":
        in_pod = bool(os.environ.get(contract.POD_NAME))
        _check_etcd(args.rdzv_endpoint, args.rdzv_conf, ETCD_WAIT_IN_POD_SECONDS if in_pod else 0.0)
    if (etcd := progress_endpoint(args)) is not None and not os.environ.get(
        contract.PROGRESS_ENDPOINT
    ):
        os.environ[contract.PROGRESS_ENDPOINT] = etcd
        _share_etcd_tls(etcd, args.rdzv_conf)
    # SIGTERM is ours (main): torch's handler would stop the workers at once.
    args.signals_to_handle = without_sigterm(args.signals_to_handle)
    # torch 2.13's agent-shared TCPStore crashed c10d scale-up (docs/design.md); ours never shares.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import run

    from elasticjob_runtime.launch.agent import MembershipAwareAgent
    from elasticjob_runtime.launch.torch_internals import launching_agents_with
    from elasticjob_runtime.rendezvous.join import RunFinishedError

    # torch's launcher builds a LocalElasticAgent; ours is a subclass with warm spares
    # that does not charge restarts for peers that left.
    agent = functools.partial(
        MembershipAwareAgent,
        warm_spares=args.warm_spares and spare_count != 0,
        warm_spare_count=spare_count,
        warm_spare_fork=args.warm_spare_fork,
        warm_imports=warm_imports,
        joined=joined,
        hang_timeout=hang_timeout,
        departure=departure,
    )
    try:
        with launching_agents_with(agent):
            run(args)  # type: ignore[no-untyped-call]
    except ChildFailedError as exc:
        print(f"{PROG}: workers failed and no restarts are left\n{exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except RunFinishedError as exc:
        # e.g. a pod the operator started for a scale-up just as training ended: the
        # job succeeded, and this pod must say so (exit 0), not fail it. The same command
        # run again lands here too: the warning says how to start afresh.
        log.warning("%s", exc)
        raise SystemExit(0) from None
    except RendezvousError as exc:
        _fail(f"rendezvous failed: {exc}", code=1)
    _forget_node_memory(str(args.rdzv_id))


def without_sigterm(signals: str) -> str:
    """torchrun's ``--signals-to-handle`` list without SIGTERM, which ``main`` handles."""
    return ",".join(s.strip() for s in signals.split(",") if s.strip() and s.strip() != "SIGTERM")


def _forget_node_memory(run_id: str) -> None:
    """The workers succeeded: their node-memory copy (checkpoints/manager.py) will never be read
    again. Outside a pod /dev/shm is the host's and would keep it until a reboot; a
    failure or a restart never gets here, and keeps it to resume from."""
    from elasticjob_runtime.checkpoints.files import default_memory_dir, remove_memory_copy
    from elasticjob_runtime.checkpoints.job_identity import workers_job

    directory = default_memory_dir(workers_job(run_id))
    if directory is not None and remove_memory_copy(directory):
        log.info("the workers succeeded: removed their node-memory checkpoint copy %s", directory)


if __name__ == "__main__":
    main()
