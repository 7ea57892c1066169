"""The join loop: read the round key, ask
:func:`~elasticjob_runtime.rendezvous.membership.decide_next` what to do, have the
:class:`~elasticjob_runtime.rendezvous.join_executor.JoinExecutor` do it, until this node is
in a sealed round.

torch's dynamic handler has the same shape (a pure join operation returning an action,
and an executor that carries it out); here each step reads one key, not the whole state.
"""

from __future__ import annotations

import logging
import time

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
)

from elasticjob_runtime import contract
from elasticjob_runtime.etcd.client import EtcdError, EtcdLeaseNotFound
from elasticjob_runtime.rendezvous.join_executor import JoinExecutor
from elasticjob_runtime.rendezvous.leases import RETRY_AFTER_S
from elasticjob_runtime.rendezvous.membership import (
    CheckSealed,
    Closed,
    Enter,
    Follow,
    Joined,
    Lead,
    Open,
    Standby,
    decide_next,
)

log = logging.getLogger(__name__)


class RunFinishedError(RendezvousClosedError):
    """The run this node asked to join has finished training: there is nothing left to
    do, which is no failure (the launcher exits 0 and says so)."""


def finished_run_message(run_id: str, etcd: str) -> str:
    """What a node that comes to a finished run is told. A late scale-up pod needs no
    more than the first clause, but the same command run again (same --rdzv-id, same etcd)
    would otherwise look like a job that trained nothing: say how to start afresh."""
    return (
        f"run {run_id} finished training before this node joined; nothing is left to do. "
        f"To train again, start a new run: another --rdzv-id, or delete this run's keys from "
        f"the etcd at {etcd} (etcdctl del --prefix {contract.run_prefix(run_id)}); a script "
        "given the same checkpoint directory resumes its finished state"
    )


def closed_error(run_id: str, etcd: str, closed: Closed) -> RendezvousClosedError:
    """What a node that comes to a closed run raises: finished (exit 0) or not."""
    if closed.finished:
        return RunFinishedError(finished_run_message(run_id, etcd))
    return RendezvousClosedError(
        f"the rendezvous of run {run_id} is closed: a node left it without finishing (out "
        "of restarts, or its rendezvous failed); a new run needs a new --rdzv-id"
    )


def join_round(ex: JoinExecutor, last_joined: int, deadline: float) -> tuple[Joined, int]:
    """Act on :func:`decide_next` until this node is in a sealed round newer than
    ``last_joined``.

    Returns the round and the etcd revision it was sealed at. An etcd outage (a restart,
    a failover) is ridden out until the join deadline.
    """
    last_call: float | None = None  # the leader's last-call deadline
    state = ex.state
    while True:
        try:
            revision, current, kv = state.read_state()
            step = decide_next(current, ex.node, ex.limits, last_joined, ex.entered, ex.leading)
            match step:
                case Joined():
                    ex.entered = None
                    assert kv is not None  # a sealed round came from its key
                    return step, kv.mod_revision
                case CheckSealed(number):
                    found = ex.check_sealed(number)
                    if found is not None:
                        return found
                case Closed():
                    raise closed_error(state.keys.run_id, state.client.where, step)
                case Standby():
                    deadline = ex.stand_by(step, kv, deadline)
                case Open():
                    ex.open(step, kv)
                case Enter(number):
                    ex.enter(number)
                case Follow():
                    ex.follow(step, revision, deadline)
                case Lead():
                    assert kv is not None and current is not None  # a forming round's key
                    last_call = ex.lead(current, kv, last_call, deadline)
        except (EtcdError, RendezvousConnectionError) as exc:
            ride_out(ex, exc, deadline)


def ride_out(ex: JoinExecutor, exc: EtcdError | RendezvousConnectionError, deadline: float) -> None:
    """An etcd request of the join failed: retry until the deadline, with new leases at
    once where etcd no longer knows ours."""
    if time.monotonic() > deadline:
        raise RendezvousConnectionError(str(exc)) from exc
    if EtcdLeaseNotFound in (type(exc), type(exc.__cause__)):
        # not worth waiting for the keeper (which may itself be cut off): a write under a
        # lease etcd lost fails the same way for ever
        ex.leases.renew(str(exc))
        return
    log.warning("etcd-v3: %s: %s; retrying", ex.node, exc)
    time.sleep(RETRY_AFTER_S)
