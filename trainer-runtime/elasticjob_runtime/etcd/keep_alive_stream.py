"""One long-lived ``LeaseKeepAlive`` stream, so a lease refresh is one message on it.

etcd's keep-alive is a bidirectional stream. The client library opens a new stream for
every refresh: a new HTTP/2 stream for etcd, and two new threads in gRPC's Python
runtime (the request consumer and the channel spin), every 0.2 s per agent with the
1 s lease a node's liveness rides on. A py-spy profile of an agent in steady training
put two thirds of its CPU there (bench/README.md, issue 36). This keeps one stream
open and sends each refresh on it: a request in, its response out, in order.

A refresh that gets no answer within its timeout, or a stream that broke, closes the
stream; the next refresh opens a new one. After a timeout no late answer can be taken
for a newer request, since that stream is gone.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

_CLOSE = object()  # ends the request iterator, which half-closes the stream


class StreamBroken(Exception):
    """The stream failed (its gRPC error is the cause) or ended; it is closed."""


class KeepAliveStream:
    """Refreshes over one stream opened by ``open_call(requests)``, which returns gRPC's
    response iterator (with ``cancel()``) for the request iterator it is given."""

    def __init__(self, open_call: Callable[[Iterator[Any]], Any], request: Callable[[int], Any]):
        self._open_call = open_call
        self._request = request  # lease id -> LeaseKeepAliveRequest
        self._lock = threading.Lock()  # one refresh at a time
        self._call: Any = None
        self._closed = False
        self._requests: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._responses: queue.SimpleQueue[object] = queue.SimpleQueue()

    def refresh(self, lease: int, timeout: float) -> int:
        """Refresh ``lease``; its TTL as etcd answered (<= 0: it has expired). Raises
        :class:`TimeoutError` (no answer within ``timeout``) or :class:`StreamBroken`;
        either way the stream is closed and the next call opens a new one."""
        with self._lock:
            if self._closed:
                raise StreamBroken("the keep-alive stream was closed")
            if self._call is None:
                self._open()
            self._requests.put(self._request(lease))
            try:
                answer = self._responses.get(timeout=timeout)
            except queue.Empty:
                self._close()
                raise TimeoutError(f"no keep-alive answer within {timeout:.2f} s") from None
            if isinstance(answer, BaseException) or answer is _CLOSE:
                self._close()
                cause = answer if isinstance(answer, BaseException) else None
                raise StreamBroken(str(cause or "the keep-alive stream ended")) from cause
            return int(answer.TTL)  # type: ignore[attr-defined]

    def close(self) -> None:
        """End the stream now, from any thread: a refresh waiting on it (a keeper being
        replaced) fails at once instead of holding this call for its timeout."""
        self._closed = True
        self._close()

    def _open(self) -> None:
        requests: queue.SimpleQueue[object] = queue.SimpleQueue()
        responses: queue.SimpleQueue[object] = queue.SimpleQueue()

        def sent() -> Iterator[Any]:
            while (item := requests.get()) is not _CLOSE:
                yield item

        call = self._open_call(sent())

        def read() -> None:
            try:
                for response in call:
                    responses.put(response)
                responses.put(_CLOSE)
            except Exception as exc:  # gRPC's error, or a cancel: the stream is over
                responses.put(exc)

        threading.Thread(target=read, name="etcd-keep-alive-stream", daemon=True).start()
        self._call, self._requests, self._responses = call, requests, responses

    def _close(self) -> None:
        """End the current stream (lock-free: ``close`` calls it while a refresh waits;
        a cancel twice, or a second end marker, is harmless)."""
        call, self._call = self._call, None
        if call is not None:
            self._requests.put(_CLOSE)
            call.cancel()
