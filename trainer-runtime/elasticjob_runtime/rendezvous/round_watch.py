"""The round a node runs, and the watch that tells it when to leave it.

Each agent watches ``rdzv/`` (the round key and the member keys) from the revision its
round was sealed at. The watch's events say what changed, so a check costs one key read
at most, however many nodes there are; only a broken watch costs a full re-read. The
rules (:func:`~elasticjob_runtime.rendezvous.membership.restart_reason`, ...) are pure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from elasticjob_runtime.etcd.client import Change, EtcdError
from elasticjob_runtime.rendezvous.membership import (
    Joined,
    Round,
    gone_on_without,
    lost_participants,
    restart_cause,
    restart_reason,
)
from elasticjob_runtime.rendezvous.state import RendezvousState

log = logging.getLogger(__name__)


class RoundWatch:
    """This node's round and the changes to it the watch has seen."""

    def __init__(
        self,
        state: RendezvousState,
        node: str,
        on_own_loss: Callable[[], None] | None = None,
    ) -> None:
        self._state = state
        self._node = node
        # Called when this node's own member key is gone while etcd answers (its lease
        # lapsed: a keeper cut off, a starved process): it announces the node again at
        # once. The round still ends (its peers saw the same deletion), and peers_lost()
        # still names this node, so its workers abandon the round's collectives.
        self._on_own_loss = on_own_loss
        self.round = 0  # the round this node last joined
        self.participants: tuple[str, ...] = ()
        self.restart_why: str | None = None
        self.restart_cause: str | None = None  # the cause of a round it opens for it
        self._changed = threading.Event()
        self._broken = threading.Event()
        self._lock = threading.Lock()
        self._state_changed = False  # the watch saw the round key change
        self._gone: set[str] = set()  # nodes whose member key the watch saw deleted
        self._leaving: set[str] = set()  # nodes whose leaving key the watch saw put
        # This node's leaving key is there (departure.py): it announced its departure, or
        # the operator marked it for a scale-down, which the watch saw. It joins no
        # further round, and its member key stays until its workers have handed over.
        self.departing = False
        self._cancel: Callable[[], None] | None = None
        # Called from the watch's thread after each change it saw is noted (the agent's
        # monitor pass starts then: launch/monitor_wake.py).
        self.on_change: Callable[[], None] = lambda: None

    def leave_round(self) -> None:
        """About to join another round: stop watching this one, forget why it ended."""
        self.stop()
        self.restart_why = None
        self.restart_cause = None

    def stop(self) -> None:
        if self._cancel is not None:
            self._cancel()
            self._cancel = None

    def begin(self, joined: Joined, sealed_at: int) -> None:
        """Run ``joined`` from now on, watching from its seal: a peer lost or a newer
        round opened since then, even before this node read the round, is in the events."""
        self.round = joined.number
        self.participants = joined.participants
        with self._lock:
            # The first check reads the round key (one key): a newer round may have
            # opened before the watch has delivered its first events.
            self._state_changed, self._gone, self._leaving = True, set(), set()
        try:
            self._watch(sealed_at)
            # A participant that announced its departure between the leader's read of
            # the live nodes and the seal is in the round but will not run it: the
            # watch starts after its key was put, so read the (usually empty) set once.
            leaving = self._state.leaving()
            with self._lock:
                self._leaving |= leaving
                self.departing = self.departing or self._node in leaving
        except EtcdError as exc:  # the first membership check watches again
            log.warning("etcd-v3: %s: cannot watch yet (%s); retrying", self._node, exc)
        self._changed.set()  # the first membership check looks at once

    def num_nodes_waiting(self) -> int:
        """Non-zero when this node must restart into a new round (a peer left or came);
        never once this node is departing (it hands its place over instead)."""
        if self.departing:
            return 0
        if self.restart_why is not None:
            return 1
        if not self._changed.is_set():
            return 0
        self._changed.clear()
        with self._lock:
            if self.departing:
                # marked since the check above: its mark comes before the round the
                # others form without it, so this node never restarts into that round
                return 0
            state_changed, gone = self._state_changed, set(self._gone)
            leaving = [p for p in self.participants if p in self._leaving and p != self._node]
            self._state_changed = False
        try:
            seen = self._what_changed(state_changed, gone, bool(leaving))
        except EtcdError as exc:
            log.warning("etcd-v3: cannot check membership: %s", exc)
            with self._lock:
                self._state_changed = self._state_changed or state_changed
            self._changed.set()
            return 0
        if seen is None:
            return 0
        self.restart_why = restart_reason(seen[0], seen[1], self.round, leaving)
        self.restart_cause = restart_cause(seen[0], seen[1], self.round, leaving)
        if self.restart_why is None:
            return 0
        log.info("etcd-v3: %s restarts its workers: %s", self._node, self.restart_why)
        return 1

    def _what_changed(
        self, state_changed: bool, gone: set[str], leaving: bool
    ) -> tuple[Round | None, list[str]] | None:
        """The round key now and the participants lost, or None if nothing changed
        (``leaving``: a participant announced its departure, which is a change)."""
        if self._broken.is_set():
            # The stream died (etcd restarted, a member failed over): watch again.
            # Comparing state, not counting events, means nothing in between is lost.
            revision, current, _, live = self._state.read()
            log.info("etcd-v3: %s: watch lost; watching again", self._node)
            self._watch(revision)
            if self._node not in live:
                self._own_loss()
            return current, lost_participants(self.participants, live)
        if self._node in gone:
            self._own_loss()
        lost = [p for p in self.participants if p in gone]
        if not state_changed and not lost and not leaving:
            return None
        _, current, _ = self._state.read_state()
        return current, lost

    def _own_loss(self) -> None:
        """Announce this node again now. Otherwise only a join's write refused for its
        lease does, and with the keeper cut off the lease taken then lapses a TTL later,
        round after round (the e2e etcd-loss test)."""
        if self._on_own_loss is None or self.departing:
            return
        try:
            self._on_own_loss()
        except EtcdError as exc:  # the keeper, or the next join's refused write, will
            log.warning("etcd-v3: %s: cannot announce itself again yet: %s", self._node, exc)

    def wait_for_change(self, timeout: float) -> str | None:
        """Why this node must move to a new round, waiting up to ``timeout`` to find out."""
        deadline = time.monotonic() + timeout
        while True:
            if self.num_nodes_waiting() > 0:
                return self.restart_why
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._changed.wait(left)

    def peers_lost(self) -> list[str]:
        """The participants whose lease is gone, or that went on to a newer round without
        this node (:func:`gone_on_without`), read now. A participant that announced its
        departure is not lost: its workers finish their step with the round's."""
        try:
            live = self._state.present()
            _, current, _ = self._state.read_state()
        except EtcdError as exc:
            log.warning("etcd-v3: cannot read the live nodes: %s", exc)
            return []
        lost = lost_participants(self.participants, live)
        gone_on = gone_on_without(current, self._node, self.round, self.participants)
        return lost + [p for p in gone_on if p not in lost]

    def _watch(self, revision: int) -> None:
        """(Re)start the watch on ``rdzv/`` from just after ``revision``."""
        self.stop()
        self._broken.clear()
        try:
            self._cancel = self._state.client.watch_prefix(
                self._state.keys.prefix,
                revision + 1,
                self._saw_change,
                self._broken.set,
                on_keys=self._note_changes,
            )
        except EtcdError:
            # Right after etcd comes back, gRPC may refuse the new stream even though a
            # read just worked: stay "broken" so the next check tries again, rather than
            # believing a watch exists and never hearing of a change.
            self._broken.set()
            raise

    def _saw_change(self) -> None:
        """From the watch thread, after the change is noted (or the watch broke: the next
        pass at the agent's own interval re-reads, so a watch that breaks again at once
        is not re-armed at etcd's speed)."""
        self._changed.set()
        if not self._broken.is_set():
            self.on_change()

    def _note_changes(self, changes: list[Change]) -> None:
        """From the watch thread: which keys changed, for the next membership check."""
        keys = self._state.keys
        with self._lock:
            for change in changes:
                if change.key == keys.state:
                    self._state_changed = True
                elif change.deleted and change.key.startswith(keys.members):
                    self._gone.add(change.key[len(keys.members) :])
                elif not change.deleted and change.key.startswith(keys.leaving):
                    node = change.key[len(keys.leaving) :]
                    self._leaving.add(node)
                    # its own key, put by the operator (a scale-down): it departs as it
                    # would on a SIGTERM (the agent's monitor pass hands over)
                    self.departing = self.departing or node == self._node
