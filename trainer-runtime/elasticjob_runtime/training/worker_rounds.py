"""Which round a worker is in, and how it moves to the next one without exiting.

A worker under ``elasticjob-run`` takes each round's rank and world from its agent
(:mod:`elasticjob_runtime.launch.channel`) and builds that round's process group
(:mod:`elasticjob_runtime.training.round_group`). :class:`WorkerRounds` holds the current round
and carries out a regroup: leave the old group (aborting it, so peers blocked on this
worker fail now), wait for the agent's next round, build its group. A watcher thread
abandons the round's collectives as soon as the agent says the round lost a peer.
Without ``elasticjob-run`` there is one round, the launcher's, for the process's life.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from elasticjob_runtime import contract
from elasticjob_runtime.launch.channel import POLL_S, Assignment, WorkerChannel
from elasticjob_runtime.launch.wakeup import Wakeup, drain, pidfd_of
from elasticjob_runtime.training.round_group import RoundGroup, round_group
from elasticjob_runtime.training.waiting_heap import ceiling_from_env

log = logging.getLogger(__name__)

# The variables torch's agent sets per round; a regrouped worker's environment follows.
ASSIGNED = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    contract.ROUND_ID,
    contract.ROUND_CAUSE,
)
# How often the watcher thread looks for an abandoned round when nothing woke it: it
# waits on the channel's bell (the agent rings it after each delivery) and on the agent's
# pidfd, so this is only the floor for a lost ring. Where neither can be had it polls
# every WATCH_POLL_S: 100 looks a second cost about 2 % of a training step in CPU
# (measured, bench/README.md).
WATCH_IDLE_S = 1.0
WATCH_POLL_S = 0.05
# How long a worker whose group broke waits for its agent's next round.
REGROUP_TIMEOUT_S = float(os.environ.get("ELASTICJOB_REGROUP_TIMEOUT", "900"))
# What gloo says when a peer's connection is gone (torch wraps it in a RuntimeError).
GLOO_FAILURES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "[gloo")


class GroupAbandoned(dist.DistError):
    """This worker gave its round's group up (the round lost a peer) while a step ran:
    raised at the step's next forward, so the step is dropped there rather than after
    computing the rest of it for a collective that can only fail."""


class HandedOver(SystemExit):
    """This worker's node left the job and its peers went on without it from the last
    step they completed together: the process exits (0), saving nothing."""

    def __init__(self) -> None:
        super().__init__(0)


def collective_failed(exc: BaseException) -> bool:
    """Is ``exc`` a collective that failed because the group broke (not a bug here)?"""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in GLOO_FAILURES)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def solo_env() -> None:
    """A world of one when no launcher set one up (``python train.py``)."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )


def joins_running_group(env: Mapping[str, str]) -> bool:
    """Is this process started into a group that trained before (a joiner, a replacement
    for a dead worker), whose peers will wait for its first step? Not in the job's first
    round, where every member starts together, nor where the rendezvous says no cause
    (torch's own backends)."""
    return env.get(contract.ROUND_CAUSE, "start") not in ("", "start")


def assignment_from_env() -> Assignment:
    env = {name: os.environ[name] for name in ASSIGNED if name in os.environ}
    return Assignment(0, env)


def departure_seen(
    handed_over: bool, latest: Assignment | None, generation: int, world_size: int
) -> bool:
    """Do ranks leave the job when round ``generation`` (of ``world_size`` ranks) ends:
    this rank's node handed its place over, or the newer round its agent delivered
    (``latest``) is smaller? A rank whose agent has not delivered yet cannot say."""
    if handed_over:
        return True
    newer = latest is not None and latest.generation > generation
    return newer and latest is not None and latest.world_size < world_size


def abandons(latest: Assignment | None, generation: int, world_size: int, building: bool) -> bool:
    """Must this worker abandon the collectives of its round ``generation`` (of
    ``world_size`` ranks) now that its agent delivered ``latest``?

    Yes when the agent says the round lost a peer (``abort``), when the round was still
    being built, and when the newer round is of the same size: a member was replaced (a
    worker killed and restarted by its agent), so the old group is broken, though its
    collectives may not fail by themselves (a survivor sat 150 s in a shard copy's
    all-to-all with a killed peer, the agent's new round delivered). A larger round is a
    join and a smaller one a planned departure: the ranks finish the step and switch
    together (switch_vote.py)."""
    if latest is None or latest.generation <= generation:
        return False
    return latest.abort or building or latest.world_size == world_size


class WorkerRounds:
    """The current round's assignment and process group; the regroup that replaces them."""

    def __init__(self, backend: str, timeout_s: float | None, in_place: bool | None) -> None:
        """``in_place`` None: on unless ``ELASTICJOB_IN_PLACE=0``; ``timeout_s`` None: the
        process groups' collectives time out after 30 minutes."""
        solo_env()
        if in_place is None:
            in_place = os.environ.get(contract.IN_PLACE, "1") != "0"
        self.channel = WorkerChannel.from_env() if in_place else None
        current = self.channel.latest() if self.channel is not None else None
        self.generation = current.generation if current is not None else 0
        self.assignment = assignment_from_env()
        self._timeout = timedelta(seconds=timeout_s) if timeout_s else timedelta(minutes=30)
        self.group: RoundGroup = round_group(backend)
        # how far the first group's wait may grow the heap (waiting_heap.py): read here,
        # so a bad value stops the script at Run(), before anything else
        ceiling = ceiling_from_env()
        self._heap_ceiling = ceiling if joins_running_group(os.environ) else 0
        self._aborted_generation = -1
        self._round_token = ""  # take_token
        self._closed = threading.Event()
        self._wakeup = Wakeup()  # the watcher's wait; close() ends it
        self._parent = os.getppid()  # the agent; a worker whose agent died stops waiting
        self._watcher: threading.Thread | None = None
        self._building = False  # regroup() is building the next round's group
        self.on_leave: Callable[[], None] = lambda: None  # runs before HandedOver exits
        self.built = False  # the first round's group stands (build_first)

    def build_first(self) -> float:
        """Build the first round's group, once; returns the seconds it took (0 after).

        Not in the constructor: the Run builds it when the model is wrapped, so a worker
        that joins a running group (or replaces a dead one) builds its model and the
        rest of the script's set-up first, while its peers still train, instead of
        holding them in the new group for it (docs/training-loop.md)."""
        if self.built:
            return 0.0
        started = time.monotonic()
        self.group.build(self.assignment, self._timeout, grow_heap_by=self._heap_ceiling)
        self.built = True
        return time.monotonic() - started

    @property
    def rank(self) -> int:
        return self.assignment.rank

    @property
    def world_size(self) -> int:
        return self.assignment.world_size

    @property
    def local_rank(self) -> int:
        return int(self.assignment.env.get("LOCAL_RANK", "0"))

    @property
    def round_id(self) -> str:
        """The group this rank is in: the rendezvous round (``contract.ROUND_ID``, from
        elasticjob-run's etcd rendezvous; the run id alone with torch's own) and the token
        its rank 0 drew when it formed (:meth:`take_token`), so it is the same on every
        rank of the group and new at every formation, wherever round numbers restart."""
        base = self.assignment.env.get(contract.ROUND_ID) or os.environ.get(
            "TORCHELASTIC_RUN_ID", "local"
        )
        return f"{base}.{self._round_token}" if self._round_token else base

    def take_token(self, token: int) -> None:
        """Name the group just formed by rank 0's draw (formation.py gathers it)."""
        self._round_token = f"{token:08x}"

    @property
    def device(self) -> torch.device:
        return self.group.device

    def orphaned(self) -> bool:
        """Is the agent gone (nobody will hand this worker another round)?"""
        return os.getppid() != self._parent

    def switch_pending(self) -> bool:
        """Has the agent formed a newer round (a member joined a healthy group)?"""
        if self.channel is None:
            return False
        latest = self.channel.latest()
        return latest is not None and latest.generation > self.generation

    def sees_departure(self) -> bool:
        """Does this rank know that ranks leave the job when the round ends
        (:func:`departure_seen`)?"""
        latest = self.channel.latest() if self.channel is not None else None
        return departure_seen(self.handed_over(), latest, self.generation, self.world_size)

    def superseded(self) -> bool:
        """Is the round this worker took already left behind (its agent formed a newer
        one, or is gone)?"""
        return self.switch_pending() or self.orphaned()

    def handed_over(self) -> bool:
        """Did this node leave the job (channel.py, ``handed-over``)?"""
        return self.channel is not None and self.channel.handed_over()

    def leave_if_handed_over(self) -> None:
        """Exit (:class:`HandedOver`) when this node left and its peers went on without it."""
        if self.handed_over():
            log.warning("this node left the job and its peers went on without it; leaving")
            self.on_leave()
            raise HandedOver()

    @property
    def abandoned(self) -> bool:
        """Did this worker give its round up (its watcher aborted the group)?"""
        return self._aborted_generation == self.generation

    def leave_abandoned_step(self) -> None:
        """Raise :class:`GroupAbandoned` once the watcher gave this round's group up."""
        if self.abandoned:
            raise GroupAbandoned(
                f"round {self.generation}'s group was given up (a peer is gone): the step "
                "in flight is dropped at its next forward"
            )

    def group_broke(self, exc: BaseException) -> bool:
        """Did ``exc`` come from the group breaking (regroup), not from the script?"""
        return self.channel is not None and (collective_failed(exc) or self.abandoned)

    def watch(self) -> None:
        """Offer this worker for in-place rounds and start abandoning broken ones."""
        if self.channel is None:
            return
        self.channel.offer_in_place()
        self._watcher = threading.Thread(
            target=self._watch, name="elasticjob-round-watch", daemon=True
        )
        self._watcher.start()

    def _watch(self) -> None:
        """Abandon the round's collectives as soon as the agent says it lost a peer, or
        the agent is gone."""
        assert self.channel is not None
        channel = WorkerChannel(self.channel.directory, self.channel.local_rank)
        bell = channel.bell()
        agent = pidfd_of(self._parent)
        try:
            # a round delivered before the bell was open rang nobody: look once first
            self._abandon_if_broken(channel)
            while self._wait_for_news(bell, agent):
                if agent is not None and self.orphaned():
                    os.close(agent)  # readable for good now: stop waiting on it
                    agent = None
                self._abandon_if_broken(channel)
        finally:
            for fd in (bell, agent):
                if fd is not None:
                    os.close(fd)

    def _wait_for_news(self, bell: int | None, agent: int | None) -> bool:
        """Wait for the agent's ring, its exit or the floor's timeout; False once closed."""
        if self._closed.is_set():
            return False
        fds = [fd for fd in (bell, agent) if fd is not None]
        timeout = WATCH_IDLE_S if bell is not None and agent is not None else WATCH_POLL_S
        ready = self._wakeup.wait(fds, timeout)
        if bell is not None and ready and bell in ready:
            drain(bell)
        return not self._closed.is_set()

    def _abandon_if_broken(self, channel: WorkerChannel) -> None:
        """Abort this round's group once the agent's newest round says it is broken."""
        latest = channel.latest()
        generation = self.generation
        wanted = abandons(latest, generation, self.world_size, self._building)
        if not self.orphaned() and not wanted:
            return
        if self._aborted_generation < generation:
            self._aborted_generation = generation
            self.group.abort()

    def regroup(
        self,
        failed: bool,
        waiting: Callable[[], None],
        rebuild: Callable[[dict[str, float]], None],
    ) -> float:
        """Leave this round's group and build the next one; returns the seconds taken.
        ``waiting()`` runs while the worker waits (a SIGTERM then saves and exits);
        ``rebuild(timings)`` restores the state over the new group, and is tried again
        in the round after when that group breaks while forming."""
        assert self.channel is not None
        started = time.monotonic()
        while True:
            waiting()
            self.leave_if_handed_over()
            if failed:
                self.channel.request_regroup(self.generation)
            self._aborted_generation = self.generation
            self.group.abort()  # peers blocked on us fail now instead of at a timeout
            self.group.destroy()
            assignment = self._next_assignment(started, waiting)
            self.generation, self.assignment = assignment.generation, assignment
            os.environ.update(assignment.env)
            waited = time.monotonic() - started
            try:
                built = time.monotonic()
                self._building = True
                try:
                    self.group.build(assignment, self._timeout, self.superseded)
                finally:
                    self._building = False
                rebuild({"wait": waited, "process_group": time.monotonic() - built})
            except Exception as exc:
                if not collective_failed(exc):
                    raise
                log.warning("round %d broke while forming: %s", assignment.generation, exc)
                failed = True
                continue
            return time.monotonic() - started

    def _next_assignment(self, started: float, waiting: Callable[[], None]) -> Assignment:
        assert self.channel is not None
        while True:
            found = self.channel.wait_newer(self.generation, timeout=0.25)
            if found is not None:
                self.channel.say_taken(found.generation)
                return found
            waiting()
            self.leave_if_handed_over()
            if self.orphaned():
                raise RuntimeError("the elasticjob-run agent exited while its workers regrouped")
            if time.monotonic() - started > REGROUP_TIMEOUT_S:
                raise RuntimeError(
                    f"no new round from the agent within {REGROUP_TIMEOUT_S:.0f} s after the "
                    "process group broke (ELASTICJOB_REGROUP_TIMEOUT sets the limit)"
                )

    def settle(self, regroup: Callable[[], None]) -> None:
        """Before this process exits, build any round its agent formed or is forming for
        it: its other members (a node that joined as training ended) wait in that round
        for this worker, and get the final state from it (channel.py says why)."""
        if self.channel is None:
            return
        self.channel.say_finished()
        started = time.monotonic()
        while True:
            if self.switch_pending():
                regroup()
                continue
            if not self.channel.agent_regrouping():
                return
            if self.orphaned() or time.monotonic() - started > REGROUP_TIMEOUT_S:
                return  # nobody will deliver that round: leave
            time.sleep(POLL_S)

    def close(self) -> None:
        self._closed.set()
        self._wakeup.nudge()
        if self._watcher is not None:
            self._watcher.join()
        self._wakeup.close()
        self.group.destroy()
