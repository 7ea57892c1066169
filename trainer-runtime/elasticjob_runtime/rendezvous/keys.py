"""Every etcd key of the etcd-v3 rendezvous, in one place.

All of them sit under :func:`~elasticjob_runtime.contract.run_prefix`, so deleting that
prefix starts a run afresh. Torch-free and pure: the handler, the lease holder, the
backend, the tests and ``etcdctl`` instructions all name keys through here, so the layout
docs/rendezvous.md tabulates is written down once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from elasticjob_runtime import contract

# Shared with the operator, which reads the member keys and marks a scale-down's nodes
# leaving (its etcd/leaving.py): defined in the contract, named here with the others.
from elasticjob_runtime.contract import leaving_prefix, members_prefix, rdzv_prefix

__all__ = [
    "RendezvousKeys",
    "leaving_prefix",
    "members_prefix",
    "rdzv_prefix",
    "state_digest_key",
    "state_key",
]


def state_key(run_id: str) -> str:
    return rdzv_prefix(run_id) + "state"


def state_digest_key(run_id: str) -> str:
    """Where the backend keeps the SHA-256 of the state it wrote. Beside the state, not in
    it: the state stays the caller's bytes (the handler reads the round's JSON straight
    from etcd, and so can etcdctl), and one prefix read of the state key returns both at
    one revision."""
    return state_key(run_id) + ".sha256"


def _numbered(prefix: str, number: int) -> str:
    # Zero-padded so that a key range covers exactly the older rounds.
    return f"{prefix}{number:010d}/"


@dataclass(frozen=True)
class RendezvousKeys:
    """One run's keys, derived once from its id."""

    run_id: str

    @property
    def prefix(self) -> str:
        return rdzv_prefix(self.run_id)

    @property
    def state(self) -> str:
        return state_key(self.run_id)

    @property
    def members(self) -> str:
        return members_prefix(self.run_id)

    @property
    def leaving(self) -> str:
        return leaving_prefix(self.run_id)

    def leaving_key(self, node: str) -> str:
        return self.leaving + node

    def member(self, node: str) -> str:
        """The key that holds ``node`` live, on its member lease."""
        return self.members + node

    def member_names(self, keys: Iterable[str]) -> frozenset[str]:
        """The nodes whose member key is among ``keys``: the present nodes."""
        return frozenset(k[len(self.members) :] for k in keys if k.startswith(self.members))

    def leaving_names(self, keys: Iterable[str]) -> frozenset[str]:
        """The nodes whose leaving key is among ``keys``: present, but not in a next round."""
        return frozenset(k[len(self.leaving) :] for k in keys if k.startswith(self.leaving))

    def live_names(self, keys: Iterable[str]) -> frozenset[str]:
        """The live nodes: present (member key) and not leaving. A round seals with these."""
        keys = list(keys)
        return self.member_names(keys) - self.leaving_names(keys)

    def round_prefix(self, number: int) -> str:
        return _numbered(contract.run_prefix(self.run_id) + "rounds/", number)

    def joins(self, number: int) -> str:
        """Under it, one key per node that has entered round ``number``."""
        return self.round_prefix(number) + "joins/"

    def join(self, number: int, node: str) -> str:
        return self.joins(number) + node

    def sealed(self, number: int) -> str:
        """Round ``number``'s participants in rank order, written with its seal."""
        return self.round_prefix(number) + "sealed"

    def store(self, number: int) -> str:
        """The torch ``Store`` of round ``number``."""
        return _numbered(contract.run_prefix(self.run_id) + "store/", number)
