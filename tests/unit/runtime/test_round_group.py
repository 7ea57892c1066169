"""One round's process group: its sockets are shut down to abandon a collective (gloo has
no abort)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from elasticjob_runtime.training.round_group import (
    open_sockets,
    opened_between,
    round_group,
    shut_down,
)


def test_shutting_down_recorded_sockets_fails_a_blocked_read_and_spares_listeners() -> None:
    before = open_sockets()
    listener = socket.create_server(("127.0.0.1", 0))
    left, right = socket.socketpair()
    recorded = opened_between(before, open_sockets())
    assert {listener.fileno(), left.fileno(), right.fileno()} <= set(recorded)

    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(left.recv(10)))
    reader.start()
    time.sleep(0.1)
    assert shut_down(recorded) == 2  # the pair; the listener is left alone
    reader.join(timeout=5)
    assert not reader.is_alive() and got == [b""]
    listener.settimeout(0.01)
    with pytest.raises(TimeoutError):
        listener.accept()  # still listening
    for s in (listener, left, right):
        s.close()


def test_a_recorded_descriptor_reused_by_another_socket_is_not_touched() -> None:
    a, b = socket.socketpair()
    recorded = {a.fileno(): 1}  # not a's inode: the number now names something else
    assert shut_down(recorded) == 0
    a.sendall(b"x")
    assert b.recv(1) == b"x"
    a.close()
    b.close()


def test_an_unknown_backend_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'mpi' is not supported here; use 'gloo' or 'nccl'"):
        round_group("mpi")
