"""The control socket: one request and one reply shape, both ends over a real socket."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticjob_devcluster.control import (
    ControlServer,
    Op,
    ProtocolError,
    Reply,
    Request,
    call,
)


def test_every_op_round_trips_through_its_wire_form() -> None:
    for op in Op:
        req = Request(op, namespace="ns", pod="p", container="c", up=False, ready=False)
        assert Request.decode(req.encode()) == req


def test_the_wire_names_are_the_ones_older_clients_sent() -> None:
    names = {"ping", "kill", "kill-worker", "network", "node-ready", "lose-node"}
    assert names <= {op.value for op in Op}
    req = Request.decode(b'{"op": "kill", "pod": "w-0"}\n')
    assert (req.op, req.namespace, req.pod, req.container) == (Op.KILL, "default", "w-0", "")


def test_an_unknown_op_names_the_known_ones() -> None:
    with pytest.raises(ProtocolError, match="unknown op 'explode'; one of: ping, "):
        Request.decode(b'{"op": "explode"}')


def test_a_pod_op_without_a_pod_is_refused() -> None:
    with pytest.raises(ProtocolError, match="'freeze' needs the pod's name"):
        Request.decode(b'{"op": "freeze"}')


def test_a_reply_round_trips_and_must_say_ok() -> None:
    reply = Reply(ok=True, node="n", pids=[3, 4], cmdline="python x", pods=["a/b"])
    assert Reply.decode(reply.encode()) == reply
    with pytest.raises(ProtocolError, match="lacks 'ok'"):
        Reply.decode(b'{"node": "n"}')
    with pytest.raises(ProtocolError, match="not a JSON line"):
        Reply.decode(b"")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ControlServer]:
    """A server whose 'reconcile loop' answers each request with its op and pod."""
    wake, stop = threading.Event(), threading.Event()
    srv = ControlServer(tmp_path / "control.sock", wake)
    srv.start(stop)

    def loop() -> None:
        while not stop.is_set():
            if wake.wait(0.1):
                wake.clear()
                srv.handle_pending(answer)

    def answer(req: Request) -> Reply:
        if req.op == Op.THAW:
            raise RuntimeError("cannot thaw")
        return Reply(ok=True, node="n1", error=f"{req.op.value} {req.namespace}/{req.pod}")

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield srv
    stop.set()
    srv.close()
    t.join(timeout=5)


def test_a_request_is_carried_out_by_the_loop_and_answered(server: ControlServer) -> None:
    reply = call(server.path, Request(Op.FREEZE, "ns", "p"), timeout=10)
    assert reply == Reply(ok=True, node="n1", error="freeze ns/p")


def test_a_failing_handler_and_a_garbled_request_get_an_error_reply(
    server: ControlServer,
) -> None:
    reply = call(server.path, Request(Op.THAW, "ns", "p"), timeout=10)
    assert not reply.ok and reply.error == "RuntimeError: cannot thaw"

    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(server.path))
        s.sendall(b"garbage\n")
        got = Reply.decode(s.makefile("rb").readline())
    assert not got.ok and got.error.startswith("request is not a JSON line")
