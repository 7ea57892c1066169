"""Loopback ports for the bench's servers."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now on 127.0.0.1 (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
