"""The shared etcd's users and roles: authentication switched on, one user per job.

The I/O half of :mod:`elasticjob_operator.etcd.shared` (which holds the rules): every
call goes to the etcd's JSON gateway as root, with a token from the root password in the
shared Secret. The gateway ignores a client certificate's common name (etcd uses it only
on gRPC, which is what the workers speak), hence a password for the operator and none
for the jobs.

Idempotent throughout (an operator restarted mid-way, two rounds of one job, a user
removed twice): "already exists" and "not found" answers count as done. An etcd that
lost its data (its pod replaced: the chart gives it an emptyDir, like a job's own etcd)
comes back with authentication off and no users; :meth:`EtcdUsers.ensure_auth`, called
every resync, switches it on again and forgets which jobs have their user, so each job's
next round adds it again. Until then the workers' requests are refused and they retry,
as through any etcd outage.
"""

from __future__ import annotations

import http.client
import logging
import threading
from typing import Any

from elasticjob_operator.etcd import shared as shared_etcd
from elasticjob_operator.etcd.gateway import INVALID_TOKEN, Gateway, GatewayError, b64
from elasticjob_runtime.etcd.endpoints import TLSCredentials, parse_endpoints

log = logging.getLogger(__name__)

ALREADY_EXISTS = ("already exists",)
NOT_FOUND = ("not found",)


class SharedEtcdNotReady(RuntimeError):
    """The shared etcd did not answer, or refused: the message says which call and why.
    The job's round is tried again at the next trigger."""


class EtcdUsers:
    """Root's view of the shared etcd: switch authentication on, add and remove the jobs'
    users. Thread-safe (the reconcile threads share one)."""

    def __init__(
        self,
        endpoint: str,
        tls: TLSCredentials,
        password: str,
        secret: str,
        timeout: float = 5.0,
    ) -> None:
        """The etcd at ``endpoint`` (the shared one's Service), trusted and presented to
        with ``tls``, root's ``password`` from Secret ``secret`` (named in errors)."""
        self.endpoint = endpoint
        self.secret = secret
        self._member = parse_endpoints(endpoint)[0]
        self._tls = tls
        self._password = password
        self._timeout = timeout
        self._lock = threading.Lock()
        self._token: str | None = None
        self._added: set[str] = set()  # job uids whose user exists (since auth was enabled)

    # -- calls ---------------------------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any], token: str | None) -> dict[str, Any]:
        gateway = Gateway(self._member, self._tls, self._timeout, token)
        try:
            return gateway.call(path, body)
        except GatewayError:
            raise
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise SharedEtcdNotReady(
                f"the shared etcd at {self.endpoint} did not answer {path} ({exc})"
            ) from None
        finally:
            gateway.close()

    def token(self) -> str:
        """root's auth token (a new one when etcd has forgotten the last)."""
        with self._lock:
            if self._token is not None:
                return self._token
        try:
            answer = self._post(
                "/v3/auth/authenticate",
                {"name": shared_etcd.ROOT, "password": self._password},
                None,
            )
        except GatewayError as exc:
            raise SharedEtcdNotReady(
                f"the shared etcd refused the operator's root password ({exc.message}): was "
                f"Secret {self.secret} replaced while the etcd "
                "kept its data? Delete the shared etcd's pod so it starts empty"
            ) from None
        token = str(answer["token"])
        with self._lock:
            self._token = token
        return token

    def _root(self, path: str, body: dict[str, Any], ok: tuple[str, ...] = ()) -> dict[str, Any]:
        """``path`` as root; an error whose message contains one of ``ok`` is success."""
        for attempt in (1, 2):
            try:
                return self._post(path, body, self.token())
            except GatewayError as exc:
                if any(text in exc.message for text in ok):
                    return {}
                if INVALID_TOKEN in exc.message and attempt == 1:
                    with self._lock:
                        self._token = None
                    continue
                raise SharedEtcdNotReady(
                    f"the shared etcd at {self.endpoint} refused {path}: {exc.message}"
                ) from None
        raise AssertionError("unreachable")

    # -- authentication ------------------------------------------------------------------

    def ensure_auth(self) -> bool:
        """Authentication on, with the root user; True if it was off (a new or emptied
        etcd): then no job's user exists any more and each is added again."""
        try:
            enabled = bool(self._post("/v3/auth/status", {}, None).get("enabled"))
        except GatewayError:
            # with authentication on, etcd tells only a user: root, by its token
            enabled = bool(self._root("/v3/auth/status", {}).get("enabled", True))
        if enabled:
            return False
        log.info("shared etcd %s: switching authentication on", self.endpoint)
        try:
            for path, body, ok in (
                (
                    "/v3/auth/user/add",
                    {"name": shared_etcd.ROOT, "password": self._password},
                    ALREADY_EXISTS,
                ),
                ("/v3/auth/user/grant", {"user": shared_etcd.ROOT, "role": "root"}, ()),
                ("/v3/auth/enable", {}, ()),
            ):
                try:
                    self._post(path, body, None)
                except GatewayError as exc:
                    if not any(text in exc.message for text in ok):
                        raise
        except GatewayError as exc:
            raise SharedEtcdNotReady(
                f"switching authentication on in the shared etcd failed: {exc.message}"
            ) from None
        with self._lock:
            self._token = None
            self._added.clear()
        return True

    # -- the jobs' users -----------------------------------------------------------------

    def add_job(self, uid: str) -> None:
        """User and role ``job-<uid>``, allowed to read and write the job's keys only."""
        with self._lock:
            if uid in self._added:
                return
        name = shared_etcd.user_of(uid)
        prefix = shared_etcd.key_prefix(uid)
        self._root("/v3/auth/role/add", {"name": name}, ALREADY_EXISTS)
        perm = {
            "permType": "READWRITE",
            "key": b64(prefix),
            "range_end": b64(shared_etcd.prefix_end(prefix)),
        }
        self._root("/v3/auth/role/grant", {"name": name, "perm": perm})
        self._root(
            "/v3/auth/user/add", {"name": name, "options": {"no_password": True}}, ALREADY_EXISTS
        )
        self._root("/v3/auth/user/grant", {"user": name, "role": name})
        with self._lock:
            self._added.add(uid)

    def remove_job(self, uid: str) -> None:
        """The job's user and role gone (its certificate opens nothing), then its keys."""
        name = shared_etcd.user_of(uid)
        self._root("/v3/auth/user/delete", {"name": name}, NOT_FOUND)
        self._root("/v3/auth/role/delete", {"role": name}, NOT_FOUND)
        prefix = shared_etcd.key_prefix(uid)
        self._root(
            "/v3/kv/deleterange",
            {"key": b64(prefix), "range_end": b64(shared_etcd.prefix_end(prefix))},
        )
        with self._lock:
            self._added.discard(uid)

    def users(self) -> list[str]:
        """Every user of the shared etcd (root and the jobs')."""
        return [str(u) for u in self._root("/v3/auth/user/list", {}).get("users") or []]

    def remove_stale(self, users: list[str], live_uids: set[str]) -> list[str]:
        """Remove the users of jobs that are gone (:func:`shared_etcd.stale_users`):
        ``users`` listed before the jobs ``live_uids``, so a job created in between (its
        user not yet in the list) is never taken for gone."""
        stale = shared_etcd.stale_users(users, live_uids)
        for user in stale:
            uid = shared_etcd.uid_of(user)
            if uid is not None:
                self.remove_job(uid)
        return stale
