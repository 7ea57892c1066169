"""A warm template the agent's spares are forked from, so a refill imports nothing.

A fresh spare imports torch and the script's modules: about 2 CPU-seconds, taken after a
restart from the two cores the training already fills (each kill in the realistic
script's goodput run cost about 1 s of slowed steps that way: bench/README.md). The
template is one more interpreter, started and warmed exactly as a spare is
(:mod:`elasticjob_runtime.launch.spare`), that never becomes a worker: on the agent's
word it forks, and the child is a spare that is warm at once. Its pages are the
template's until written (copy-on-write), so the fork costs milliseconds of CPU and the
idle spares share the template's memory instead of holding 360 MiB each.

**A forked spare is the agent's child, as every worker torch starts is.** The agent
is a child subreaper (``PR_SET_CHILD_SUBREAPER``); the template forks an intermediate
process that forks the spare and exits at once, so the kernel hands the spare to the
agent. The agent then waits for it as for any child (:class:`ForkedProcess`), and
``ps``, ``pstree`` and fault injectors that look for the launcher's children see the
workers where torchrun puts them. Like a spare of its own, a forked spare starts its
own session (``killpg`` stops its tree alone) and dies with the agent while idle
(``PR_SET_PDEATHSIG``, armed once it is the agent's).

Being a subreaper, the agent also inherits whatever a worker that died leaves behind
(its ``DataLoader`` workers): :func:`reap_orphans` waits for those once they exit, so
none stays a zombie. (In a pod the agent is PID 1 and inherits them anyway.)

The template stays single-threaded in Python and only waits on the agent's socket, so
a fork copies no thread holding a lock that Python knows of; torch's import leaves one
native thread, as it does for a ``DataLoader``'s forked workers, which have the same
need.

Wire format, on one Unix stream socket: the agent sends one byte ``f`` with the agent's
end of a new spare's socket pair attached (``SCM_RIGHTS``); the template answers a line
``forked <pid>`` once the spare is the agent's child.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

FORK = b"f"
_PR_SET_CHILD_SUBREAPER = 36
REPARENT_TIMEOUT_S = 5.0  # a forked spare waits this long to become the agent's child


def become_subreaper() -> bool:
    """Make this process (the agent) inherit its descendants' orphans; False where the
    kernel refuses (then spares are not forked: they would not be its children)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


# ---------------------------------------------------------------- the template's side


def serve_forks(control: socket.socket, agent: int) -> socket.socket | None:
    """The template's loop: fork a spare for the agent per request.

    Returns only in a forked spare, with its socket to the agent; in the template it
    returns None once the agent closed the control socket (it is done, or gone)."""
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(control, 1, 1)
        except OSError:
            fds = []
        if not fds:
            return None  # end of file: the agent closed its end
        read_end, write_end = os.pipe()
        middle = os.fork()
        if middle == 0:  # the intermediate: fork the spare, say its pid, exit
            os.close(read_end)
            spare = os.fork()
            if spare == 0:
                os.close(write_end)
                control.close()
                return _become_spare(fds[0], agent)
            os.write(write_end, str(spare).encode())
            os._exit(0)
        os.close(write_end)
        os.close(fds[0])
        with os.fdopen(read_end, "rb") as pipe:
            pid = pipe.read()
        os.waitpid(middle, 0)  # gone: the spare is the agent's child from here on
        with contextlib.suppress(OSError):  # the agent is gone: nobody to tell
            control.sendall(f"forked {int(pid)}\n".encode())


def _become_spare(fd: int, agent: int) -> socket.socket:
    """The forked spare: the agent's child in a session of its own, dead with the agent
    while idle, with fresh random state where a fork would share the template's."""
    os.setsid()
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() != agent:  # until the intermediate's exit hands it over
        if time.monotonic() > deadline:
            os._exit(0)  # the agent is gone (or no subreaper): nobody to serve
        time.sleep(0.001)
    from elasticjob_runtime.launch.spare import set_parent_death_signal

    set_parent_death_signal(int(signal.SIGKILL))
    if os.getppid() != agent:
        os._exit(0)  # the agent died before the death signal was armed
    with contextlib.suppress(ImportError):  # ps: an idle spare, not a second template
        from setproctitle import setproctitle

        setproctitle(f"{sys.executable} -m elasticjob_runtime.launch.spare --forked-for={agent}")
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:  # Python's `random` reseeds itself after a fork
        with contextlib.suppress(Exception):
            numpy_random.seed()
    return socket.socket(fileno=fd)


# ---------------------------------------------------------------- the agent's side


def fork_spare(
    control: socket.socket, spare_end: socket.socket, timeout: float = 5.0
) -> ForkedProcess | None:
    """Ask the template on ``control`` to fork a spare whose socket to the agent is the
    pair of ``spare_end``; None if it cannot (it died, or did not answer within
    ``timeout``). One request at a time: the template answers each with one line."""
    try:
        socket.send_fds(control, [FORK], [spare_end.fileno()])
    except OSError:
        return None
    deadline, answer = time.monotonic() + timeout, b""
    while not answer.endswith(b"\n"):
        try:
            readable, _, _ = select.select([control], [], [], max(deadline - time.monotonic(), 0))
            chunk = control.recv(64) if readable else b""
        except (OSError, ValueError):
            chunk = b""
        if not chunk:
            return None  # timed out, or the template is gone
        answer += chunk
    kind, _, pid = answer.decode().strip().partition(" ")
    return ForkedProcess(int(pid)) if kind == "forked" else None


class ForkedProcess:
    """The ``Popen`` of a forked spare, the agent's child: what torch's handler and the
    pool use of one (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.args = f"spare {pid} forked from the template"
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: how it ended is not known
                self.returncode = 1
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


def reap_orphans() -> list[int]:
    """Wait for this process's zombie children that lead no session: the orphans it
    inherited as a subreaper (a dead worker's ``DataLoader`` workers). Every child the
    agent starts itself leads a session of its own (torch's workers, spares, the
    template), and its ``Popen`` waits for it: those are never touched. Returns the
    pids reaped."""
    reaped = []
    for pid in _children():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        state, session = fields[0], int(fields[3])
        if state == "Z" and session != pid:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    reaped.append(pid)
    return reaped


def _children() -> set[int]:
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                found.update(
                    int(p) for p in Path(f"/proc/self/task/{task}/children").read_text().split()
                )
    return found
