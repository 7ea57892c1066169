"""The agent side of ``bench.rdzv_scale``: many light rendezvous agents in one process.

A real agent is a process of its own, but a thousand interpreters with torch imported
do not fit on the bench machine, so each process here runs several handlers, one thread
each, and no workers. ``bench.rdzv_scale`` starts a few of these processes and talks to
them in JSON lines, so that the timestamps it computes rounds from are taken where the
handlers run:

* out (stdout): ``ready`` once every handler is built (and, for ours, registered, as
  torchrun's ``handler_from_params`` does before the agent joins), then ``joined`` or
  ``failed`` per agent per round, with wall-clock ``start``/``end``, and ``cpu`` (this
  process's CPU seconds) when all its agents are through a round;
* in (stdin): ``go <t0>``: every agent calls ``next_rendezvous()`` at wall time ``t0``
  (one start for all processes, so "the first join" is well-defined); ``lost``: a peer
  was lost (torch's agent learns it from its workers' failed collective; ours waits on
  its own watch instead). stdin closing means the parent is gone: exit at once.

``store`` mode hosts the baseline's ``TCPStore`` in a process the bench can kill by pid.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore  # type: ignore[attr-defined]
from torch.distributed.elastic.rendezvous import RendezvousHandler
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.etcd.endpoints import parse_endpoints
from elasticjob_runtime.rendezvous.handler import EtcdV3RendezvousHandler
from elasticjob_runtime.rendezvous.membership import Limits

OURS, TORCH = "ours", "torch"
LOCAL_ADDR = "127.0.0.1"

_emit_lock = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout; threads share the pipe, so one line at a time."""
    line = json.dumps({"e": event, **fields})
    with _emit_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class Settings:
    impl: str
    endpoint: str  # etcd host:port (ours) or the TCPStore's host:port (torch)
    run_id: str
    agents: int
    min_nodes: int
    max_nodes: int
    last_call: float
    lease_ttl: int
    timeout: float  # join timeout, and each client's request timeout bound
    read_timeout: float
    lost: bool  # after the first round, wait for a lost peer and join the next round


def make_handlers(s: Settings) -> list[RendezvousHandler]:
    """``s.agents`` handlers, each with its own connection, as separate agents would have."""
    handlers: list[RendezvousHandler] = []
    for _ in range(s.agents):
        if s.impl == OURS:
            client = EtcdClient(parse_endpoints(s.endpoint), timeout=s.read_timeout)
            ours = EtcdV3RendezvousHandler(
                client,
                s.run_id,
                Limits(s.min_nodes, s.max_nodes, last_call=s.last_call),
                LOCAL_ADDR,
                join_timeout=s.timeout,
                lease_ttl=s.lease_ttl,
                watch_peers=False,  # hundreds of agents to a process: see the handler
            )
            ours.register()
            handlers.append(ours)
        else:
            host, port = s.endpoint.rsplit(":", 1)
            store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=s.timeout))
            backend = C10dRendezvousBackend(store, s.run_id)
            handlers.append(
                DynamicRendezvousHandler.from_backend(
                    s.run_id,
                    store,
                    backend,
                    s.min_nodes,
                    s.max_nodes,
                    local_addr=LOCAL_ADDR,
                    timeout=RendezvousTimeout(
                        join=timedelta(seconds=s.timeout),
                        last_call=timedelta(seconds=s.last_call),
                    ),
                )
            )
    return handlers


class Countdown:
    """Calls ``done`` once ``count`` agents have reported (joined or failed) a phase."""

    def __init__(self, count: int, done: Callable[[], None]) -> None:
        self._left = count
        self._done = done
        self._lock = threading.Lock()

    def tick(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._done()


def join_once(
    index: int,
    handler: RendezvousHandler,
    phase: str,
    after: Countdown,
    whole: int | None = None,
    timeout: float = 0.0,
) -> bool:
    """One ``next_rendezvous()``, reported with its wall-clock start and end.

    ``whole``: re-join, as torch's agent does when told nodes are waiting, until the round
    has that many nodes (within ``timeout``). For a round that is only the set-up of a
    later measurement: an agent starved of CPU past the last call lands in the next round.
    """
    start = time.time()
    try:
        info = handler.next_rendezvous()
        while whole is not None and info.world_size < whole:
            if time.time() - start > timeout:
                raise TimeoutError(f"no round of {whole} within {timeout:.0f}s")
            if handler.num_nodes_waiting() > 0:
                info = handler.next_rendezvous()
            else:
                time.sleep(0.1)
    except Exception as exc:
        emit("failed", a=index, phase=phase, t=time.time(), error=f"{type(exc).__name__}: {exc}")
        after.tick()
        return False
    emit(
        "joined",
        a=index,
        phase=phase,
        start=start,
        end=time.time(),
        rank=info.rank,
        world=info.world_size,
    )
    after.tick()
    return True


def agent(
    index: int,
    handler: RendezvousHandler,
    s: Settings,
    go: threading.Event,
    start_at: list[float],
    lost: threading.Event,
    rounds: Sequence[Countdown],
) -> None:
    go.wait()
    time.sleep(max(0.0, start_at[0] - time.time()))
    whole = s.max_nodes if s.lost else None  # the lost run's first round is its set-up
    if not join_once(index, handler, "round", rounds[0], whole, s.timeout) or not s.lost:
        return
    if isinstance(handler, EtcdV3RendezvousHandler):
        # ours: its own watch says when a peer's lease ran out (no hint from the bench)
        why = handler.wait_for_membership_change(s.timeout)
        if why is None:
            emit("failed", a=index, phase="lost", t=time.time(), error="no change noticed")
            rounds[1].tick()
            return
    else:
        # torch's agent has no such wait; it re-joins when its workers fail, which a
        # peer's death causes at once (gloo sees the reset): the bench says when
        lost.wait()
    emit("noticed", a=index, t=time.time())
    join_once(index, handler, "lost", rounds[1])


def report_cpu(phase: str) -> Callable[[], None]:
    """What the last agent through ``phase`` calls: this process's CPU seconds so far."""
    return lambda: emit("cpu", phase=phase, s=cpu_seconds())


def run_agents(s: Settings) -> int:
    handlers = make_handlers(s)
    go, lost = threading.Event(), threading.Event()
    start_at = [0.0]
    rounds = [Countdown(len(handlers), report_cpu(phase)) for phase in ("round", "lost")]
    threads = [
        threading.Thread(
            target=agent, args=(i, h, s, go, start_at, lost, rounds), daemon=True, name=f"a{i}"
        )
        for i, h in enumerate(handlers)
    ]
    for t in threads:
        t.start()
    emit("ready", pid=os.getpid(), agents=len(handlers), cpu=cpu_seconds())
    for line in sys.stdin:
        word, _, rest = line.strip().partition(" ")
        if word == "go":
            start_at[0] = float(rest)
            go.set()
        elif word == "lost":
            lost.set()
    # The parent closed stdin (it is done or gone): no cleanup, the etcd and the store
    # are the bench's own and die with it.
    os._exit(0)


def host_store(timeout: float) -> int:
    """The baseline's TCPStore, hosted here so the bench can kill it by its pid."""
    store = TCPStore(
        LOCAL_ADDR,
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
    )
    emit("store", port=store.port)
    sys.stdin.read()
    os._exit(0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rdzv_agents", description=__doc__)
    sub = parser.add_subparsers(dest="mode", required=True)
    store = sub.add_parser("store", help="host the baseline's TCPStore")
    store.add_argument("--timeout", type=float, default=300)
    agents = sub.add_parser("agents", help="run rendezvous agents in threads")
    agents.add_argument("--impl", choices=(OURS, TORCH), required=True)
    agents.add_argument("--endpoint", required=True)
    agents.add_argument("--run-id", required=True)
    agents.add_argument("--agents", type=int, required=True)
    agents.add_argument("--min", type=int, required=True)
    agents.add_argument("--max", type=int, required=True)
    agents.add_argument("--last-call", type=float, default=1.0)
    agents.add_argument("--lease-ttl", type=int, default=1)
    agents.add_argument("--timeout", type=float, default=120)
    agents.add_argument("--read-timeout", type=float, default=30)
    agents.add_argument("--lost", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    if args.mode == "store":
        return host_store(args.timeout)
    return run_agents(
        Settings(
            impl=args.impl,
            endpoint=args.endpoint,
            run_id=args.run_id,
            agents=args.agents,
            min_nodes=args.min,
            max_nodes=args.max,
            last_call=args.last_call,
            lease_ttl=args.lease_ttl,
            timeout=args.timeout,
            read_timeout=args.read_timeout,
            lost=args.lost,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
