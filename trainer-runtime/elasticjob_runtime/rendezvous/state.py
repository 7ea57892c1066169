"""What a node reads of the rendezvous and the one write it makes to the round key.

torch's dynamic handler keeps a state holder that syncs with its backend; ours reads
less at a time (the round key alone is O(1); the live nodes, a round's joins and the
whole ``rdzv/`` prefix only where a rule needs them) and writes through
:class:`~elasticjob_runtime.rendezvous.backend.EtcdV3RendezvousBackend`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from elasticjob_runtime.etcd.client import EtcdClient, EtcdError, KeyValue
from elasticjob_runtime.etcd.records import Member, decode_member
from elasticjob_runtime.rendezvous.backend import EtcdV3RendezvousBackend
from elasticjob_runtime.rendezvous.keys import RendezvousKeys
from elasticjob_runtime.rendezvous.membership import Round, decode_participants

log = logging.getLogger(__name__)


class RendezvousState:
    """Reads and writes of one run's rendezvous keys; holds nothing but the connection."""

    def __init__(self, client: EtcdClient, keys: RendezvousKeys) -> None:
        self.client = client
        self.keys = keys
        self._backend = EtcdV3RendezvousBackend(client, keys.run_id)

    def use_lease(self, lease: int) -> None:
        """Write the round key under ``lease`` (the run's) from now on."""
        self._backend.lease = lease

    def read(self) -> tuple[int, Round | None, KeyValue | None, frozenset[str]]:
        """One snapshot of ``rdzv/``: revision, round, its key, and the live nodes (present
        and not leaving). O(N): only where the watch's events cannot be trusted (it broke)."""
        snap = self.client.snapshot(self.keys.prefix)
        kv = snap.items.get(self.keys.state)
        current = Round.decode(kv.value) if kv is not None else None
        return snap.revision, current, kv, self.keys.live_names(snap.items)

    def read_state(self) -> tuple[int, Round | None, KeyValue | None]:
        """The round key alone, with the revision it was read at: O(1)."""
        snap = self.client.snapshot(self.keys.state)
        kv = snap.items.get(self.keys.state)
        return snap.revision, (Round.decode(kv.value) if kv is not None else None), kv

    def live(self) -> tuple[int, frozenset[str]]:
        """The nodes a next round is made of (member key present, not leaving), with the
        revision read at. The leaving keys sit beside the member keys under ``rdzv/``."""
        snap = self.client.snapshot(self.keys.prefix)
        return snap.revision, self.keys.live_names(snap.items)

    def present(self) -> frozenset[str]:
        """The nodes whose member key is there, leaving or not: those whose workers still
        take part in their round's collectives."""
        return self.keys.member_names(self.client.snapshot(self.keys.members).items)

    def leaving(self) -> frozenset[str]:
        """The nodes that announced their departure (usually none: one empty range read)."""
        return self.keys.leaving_names(self.client.snapshot(self.keys.leaving).items)

    def members(self, nodes: Iterable[str]) -> dict[str, tuple[Member, int]]:
        """What the member keys of ``nodes`` hold, with the lease each is under (one
        range read; a node whose key is gone, or holds no record, is left out)."""
        items = self.client.snapshot(self.keys.members).items
        found = {node: _published(items.get(self.keys.member(node))) for node in nodes}
        return {node: member for node, member in found.items() if member is not None}

    def member(self, node: str) -> tuple[Member, int] | None:
        """What ``node``'s member key holds, with its lease (one key); None if the key is
        gone or holds no record this runtime can read."""
        return _published(self.client.get(self.keys.member(node)))

    def is_live(self, node: str) -> bool:
        """One key: is ``node``'s member lease still there (leaving or not)?"""
        return self.client.get(self.keys.member(node)) is not None

    def is_leaving(self, node: str) -> bool:
        """One key: is ``node``'s leaving key there (it announced its departure, or the
        operator marked it)?"""
        return self.client.get(self.keys.leaving_key(node)) is not None

    def has_entered(self, number: int, node: str) -> bool:
        """One key: is ``node``'s join key for round ``number`` still there?"""
        return self.client.get(self.keys.join(number, node)) is not None

    def joins(self, number: int) -> tuple[int, list[str]]:
        """Who has entered round ``number``, in the order they entered."""
        prefix = self.keys.joins(number)
        snap = self.client.snapshot(prefix)
        ordered = sorted(snap.items.values(), key=lambda kv: kv.mod_revision)
        return snap.revision, [kv.key[len(prefix) :] for kv in ordered]

    def sealed_record(self, number: int) -> tuple[tuple[str, ...], int] | None:
        """Round ``number``'s participants as sealed, and the revision of the seal."""
        kv = self.client.get(self.keys.sealed(number))
        if kv is None:
            return None
        return decode_participants(kv.value), kv.mod_revision

    def write(
        self, new: Round, kv: KeyValue | None, also: Mapping[str, bytes] | None = None
    ) -> bool:
        """Compare-and-set the round key (and ``also``, in the same transaction)."""
        token = None if kv is None else kv.mod_revision
        result = self._backend.set_state(new.encode(), token, also)
        return result is not None and result[2]

    def drop_rounds_before(self, number: int) -> None:
        """Finished rounds' keys are no use to anyone; keep etcd small."""
        try:
            self.client.delete_range(self.keys.store(0), self.keys.store(number))
            self.client.delete_range(self.keys.round_prefix(0), self.keys.round_prefix(number))
        except EtcdError as exc:
            log.warning("etcd-v3: could not drop old rounds' keys: %s", exc)


def _published(kv: KeyValue | None) -> tuple[Member, int] | None:
    """A member key's record and lease; None if there is no key, or a record this runtime
    cannot read (its lease then decides for it)."""
    if kv is None:
        return None
    try:
        return decode_member(kv.value), kv.lease
    except ValueError:
        return None
