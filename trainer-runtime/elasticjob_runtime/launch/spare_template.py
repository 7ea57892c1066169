"""A warm template the agent's spares are forked from, so a refill imports nothing.

A fresh spare imports torch and the script's modules: about 2 CPU-seconds, taken after a
restart from the two cores the training already fills (each kill in the realistic
script's goodput run cost about 1 s of slowed steps that way: bench/README.md). The
template is one more interpreter, started and warmed exactly as a spare is
(:mod:`elasticjob_runtime.launch.spare`), that never becomes a worker: on the agent's
word it forks, and the child is a spare that is warm at once. Its pages are the
template's until written (copy-on-write), so the fork costs milliseconds of CPU and the
idle spares share the template's memory instead of holding 360 MiB each.

The template stays single-threaded in Python and only waits (on the agent's socket and
on its children's pidfds), so a fork copies no thread holding a lock that Python knows
of; torch's import leaves one native thread, as it does for a ``DataLoader``'s forked
workers, which have the same need.

The forked spare is the template's child, not the agent's, so the agent cannot
``waitpid`` it: the template reaps its children and sends each exit status to the
agent, and :class:`ForkedProcess` is the ``Popen`` torch's handler polls, built on those
messages. Each child starts its own session (``killpg`` stops its tree alone, as for a
``Popen(start_new_session=True)``) and dies with the template while idle
(``PR_SET_PDEATHSIG``); the template dies with the agent.

Wire format, on one Unix stream socket: the agent sends one byte ``f`` with the agent's
end of a new spare's socket pair attached (``SCM_RIGHTS``); the template answers lines
``forked <pid>`` and, whenever a child exits, ``exited <pid> <returncode>`` (negative:
killed by that signal, as ``Popen.returncode`` says).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

FORK = b"f"


# ---------------------------------------------------------------- the template's side


def serve_forks(control: socket.socket) -> socket.socket | None:
    """The template's loop: fork a spare per request and report its children's exits.

    Returns only in a forked child, with that spare's socket to the agent; in the
    template it returns None once the agent closed the control socket (the agent is
    done, or gone)."""
    children: dict[int, int] = {}  # pidfd -> pid
    agent = control.fileno()
    while True:
        readable, _, _ = select.select([agent, *children], [], [])
        for fd in readable:
            if fd == agent:
                continue
            pid = children.pop(fd)
            os.close(fd)
            _, status = os.waitpid(pid, 0)
            _send(control, f"exited {pid} {os.waitstatus_to_exitcode(status)}")
        if agent not in readable:
            continue
        try:
            _, fds, _, _ = socket.recv_fds(control, 1, 1)
        except OSError:
            fds = []
        if not fds:
            return None  # end of file: the agent closed its end
        template = os.getpid()
        pid = os.fork()
        if pid == 0:
            for fd in children:
                os.close(fd)
            control.close()
            return _become_child(fds[0], template)
        os.close(fds[0])
        children[os.pidfd_open(pid)] = pid
        _send(control, f"forked {pid}")


def _become_child(fd: int, template: int) -> socket.socket:
    """The forked spare: its own session, dead with the template while idle, and fresh
    random state where a fork would otherwise share the template's."""
    os.setsid()
    from elasticjob_runtime.launch.spare import set_parent_death_signal

    set_parent_death_signal(int(signal.SIGKILL))
    if os.getppid() != template:
        os._exit(0)  # the template died before the death signal was armed
    with contextlib.suppress(ImportError):  # ps: an idle spare, not a second template
        from setproctitle import setproctitle

        setproctitle(
            f"{sys.executable} -m elasticjob_runtime.launch.spare --forked-from={template}"
        )
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:  # Python's `random` reseeds itself after a fork
        with contextlib.suppress(Exception):
            numpy_random.seed()
    return socket.socket(fileno=fd)


def _send(control: socket.socket, line: str) -> None:
    with contextlib.suppress(OSError):  # the agent is gone: nobody to tell
        control.sendall(f"{line}\n".encode())


# ---------------------------------------------------------------- the agent's side


@dataclass
class SpareTemplate:
    """The agent's end of a started template: fork spares, learn their exits."""

    proc: subprocess.Popen[bytes]
    control: socket.socket
    env: dict[str, str]  # the agent's environment it was started with (its forks share it)
    warm: bool = False  # the template said its imports are done
    exits: dict[int, int] = field(default_factory=dict)  # pid -> returncode, reported
    _buffer: bytes = b""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: bool = False

    def alive(self) -> bool:
        return not self._closed and self.proc.poll() is None

    def fork(self, spare_end: socket.socket, timeout: float = 5.0) -> ForkedProcess | None:
        """Fork a spare whose socket to the agent is the pair of ``spare_end``; None if
        the template cannot (it died, or did not answer within ``timeout``)."""
        with self._lock:
            try:
                socket.send_fds(self.control, [FORK], [spare_end.fileno()])
            except OSError:
                self._closed = True
                return None
            deadline = time.monotonic() + timeout
            while True:
                for kind, pid, _ in self._read_lines():
                    if kind == "forked":
                        return ForkedProcess(pid, self)
                left = deadline - time.monotonic()
                if self._closed or left <= 0 or not self._wait_readable(left):
                    return None

    def returncode(self, pid: int, timeout: float = 0.0) -> int | None:
        """``pid``'s exit status if the template reported it within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if pid not in self.exits and not self._closed:
                    self._read_lines()
                if pid in self.exits:
                    return self.exits[pid]
                if self._closed:
                    status = _status_without_template(pid)
                    if status is not None:
                        return status
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if self._closed:
                time.sleep(min(left, 0.1))
                continue
            with self._lock:
                self._wait_readable(min(left, 0.1))

    def _wait_readable(self, timeout: float) -> bool:
        if self._closed:
            return False
        try:
            readable, _, _ = select.select([self.control], [], [], timeout)
        except (OSError, ValueError):  # closed under us (close() from another thread)
            return False
        return bool(readable)

    def _read_lines(self) -> list[tuple[str, int, int]]:
        """Every complete message waiting on the socket (without blocking); exits are
        recorded as they are read, forks returned to the caller."""
        while True:
            try:
                chunk = self.control.recv(4096, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                self._closed = True
                break
            self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        parsed: list[tuple[str, int, int]] = []
        for raw in lines:
            kind, *numbers = raw.decode().split()
            if kind == "exited":
                self.exits[int(numbers[0])] = int(numbers[1])
            else:  # a reused pid: an earlier child's exit was reported before this fork
                self.exits.pop(int(numbers[0]), None)
            parsed.append((kind, int(numbers[0]), int(numbers[1]) if len(numbers) > 1 else 0))
        return parsed

    def close(self) -> None:
        """End the template (end of file on its socket, then its session killed). Workers
        it forked run in sessions of their own and outlive it."""
        self._closed = True
        self.control.close()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5.0)


def _status_without_template(pid: int) -> int | None:
    """A child's status once its template is gone and cannot reap it: running (None)
    while its pid runs; once it has exited (or is a zombie nobody reaps), a failure (1),
    since how it ended is not known."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][:1]
    except (OSError, IndexError):
        return 1
    return 1 if state in ("Z", "X") else None


class ForkedProcess:
    """The ``Popen`` of a spare forked by the template: what torch's handler and the
    pool use of one (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``)."""

    def __init__(self, pid: int, template: SpareTemplate) -> None:
        self.pid = pid
        self.args = f"spare forked from template {template.proc.pid}"
        self.returncode: int | None = None
        self._template = template

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._template.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            limit = float("inf") if timeout is None else timeout
            self.returncode = self._template.returncode(self.pid, limit)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
