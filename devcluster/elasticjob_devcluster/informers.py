"""The node agent's view of the cluster: list-then-watch informers filling one cache.

Each kind has a thread that lists it, then watches from that resourceVersion, and
relists on any error or expiry; every change calls `changed(kind)`, which wakes the
reconcile loop. The loop and the other threads only read the cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from elasticjob_devcluster.kubeapi import TIMEOUT, Obj, Watch, key, raw

log = logging.getLogger("elasticjob_devcluster.informers")

KINDS = ("pods", "services", "nodes", "pvcs", "pvs")
WATCH_TIMEOUT_S = 120


class Cache:
    """The watched objects (raw JSON dicts) by kind and namespace/name."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objs: dict[str, dict[str, Obj]] = {k: {} for k in KINDS}
        self.synced: set[str] = set()

    def items(self, kind: str) -> list[Obj]:
        with self.lock:
            return list(self.objs[kind].values())

    def get(self, kind: str, name: str) -> Obj | None:
        with self.lock:
            return self.objs[kind].get(name)

    def all_synced(self) -> bool:
        """Every kind has been listed once (before that, absence means nothing)."""
        return len(self.synced) == len(self.objs)


def informer(
    cache: Cache,
    kind: str,
    list_fn: Callable[..., Any],
    changed: Callable[[str], None],
    stop: threading.Event,
) -> None:
    """List then watch `kind` into the cache until `stop` (relist on any error or 410)."""
    while not stop.is_set():
        try:
            data = raw(list_fn(_preload_content=False, _request_timeout=TIMEOUT))
            fresh = {key(o): o for o in data.get("items") or []}
            with cache.lock:
                cache.objs[kind] = fresh
                cache.synced.add(kind)
            changed(kind)
            w = Watch()
            for ev in w.stream(
                list_fn,
                resource_version=data["metadata"]["resourceVersion"],
                timeout_seconds=WATCH_TIMEOUT_S,
                allow_watch_bookmarks=True,
                deserialize=False,
                _request_timeout=WATCH_TIMEOUT_S + 30,
            ):
                if stop.is_set():
                    w.stop()
                    return
                etype, obj = ev["type"], ev.get("raw_object") or ev["object"]
                if etype == "ERROR":
                    break
                if etype == "BOOKMARK":
                    continue
                with cache.lock:
                    if etype == "DELETED":
                        cache.objs[kind].pop(key(obj), None)
                    else:
                        cache.objs[kind][key(obj)] = obj
                changed(kind)
        except Exception as e:
            if not stop.is_set():
                log.warning("watch %s: %s; relisting", kind, e)
                time.sleep(1)


def start(
    cache: Cache,
    list_fns: dict[str, Callable[..., Any]],
    changed: Callable[[str], None],
    stop: threading.Event,
) -> None:
    """One daemon informer thread per kind."""
    for kind, fn in list_fns.items():
        threading.Thread(
            target=informer,
            args=(cache, kind, fn, changed, stop),
            name=f"watch-{kind}",
            daemon=True,
        ).start()
