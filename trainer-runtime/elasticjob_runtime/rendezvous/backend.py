"""The round key on etcd under torch's ``RendezvousBackend`` contract.

State bytes plus a token (the key's ``mod_revision``), compare-and-set in one
transaction, so it also plugs into torch's ``DynamicRendezvousHandler``; the etcd-v3
handler writes its rounds through it too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

# The .api submodule, not the package: torch loads the rendezvous entry point while the
# package itself is still initialising.
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elasticjob_runtime import contract
from elasticjob_runtime.etcd.client import EtcdClient, EtcdError
from elasticjob_runtime.rendezvous.keys import state_digest_key, state_key

BACKEND_NAME = "etcd-v3"


def state_digest(state: bytes) -> bytes:
    return hashlib.sha256(state).hexdigest().encode()


def state_problem(state: bytes, digest: bytes | None, digest_key: str) -> str | None:
    """Why ``state`` is not one the backend wrote, or None. torch's backends store base64
    and call a value that does not decode corrupt; ours stores the bytes as they are, so a
    digest written in the same transaction is what tells a foreign value apart."""
    if digest is None:
        return (
            f"{digest_key}, which the etcd-v3 backend writes with every state, is missing: "
            "something else wrote the state"
        )
    if digest != state_digest(state):
        return (
            f"its SHA-256 is not the one in {digest_key}, written with it: something other "
            "than the etcd-v3 backend overwrote it"
        )
    return None


class EtcdV3RendezvousBackend(RendezvousBackend):
    """Rendezvous state in one etcd key; the token is the key's ``mod_revision``.

    torch's contract (``test_torch_contracts.py`` holds it here): an etcd that cannot be
    reached is a ``RendezvousConnectionError``, a stored state the backend did not write a
    ``RendezvousStateError`` (see :func:`state_problem`).
    """

    def __init__(self, client: EtcdClient, run_id: str, lease: int | None = None) -> None:
        if not run_id:
            raise ValueError("the run id must be a non-empty string (set --rdzv-id / PET_RDZV_ID)")
        self._client = client
        self._run_id = run_id
        self._key = state_key(run_id)
        self._digest_key = state_digest_key(run_id)
        self.lease = lease

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Any] | None:
        try:
            found = self._client.snapshot(self._key).items  # the state and its digest
        except EtcdError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        kv = found.get(self._key)
        if kv is None:
            return None
        digest = found.get(self._digest_key)
        problem = state_problem(
            kv.value, None if digest is None else digest.value, self._digest_key
        )
        if problem is not None:
            raise RendezvousStateError(
                f"the rendezvous state {self._key} in etcd at {self._client.where} is corrupt: "
                f"{problem}. To start the run afresh, delete its keys (etcdctl del --prefix "
                f"{contract.run_prefix(self._run_id)}) or use another --rdzv-id"
            )
        return kv.value, kv.mod_revision

    def set_state(
        self, state: bytes, token: Any | None = None, also: Mapping[str, bytes] | None = None
    ) -> tuple[bytes, Any, bool] | None:
        """Write ``state`` if nobody wrote since ``token``; return what is stored now.

        A token that is not one of ours (or None) means "only if the key is absent",
        which is what a node that has never read the state wants. ``also`` (not part of
        torch's contract): keys written in the same transaction, only if ``state`` is; the
        state's digest is always one of them.
        """
        revision = token if isinstance(token, int) and not isinstance(token, bool) else None
        written = {self._digest_key: state_digest(state), **(also or {})}
        try:
            ok, kv = self._client.compare_and_set(self._key, state, revision, self.lease, written)
        except EtcdError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        if kv is None:
            return None
        return kv.value, kv.mod_revision, ok
