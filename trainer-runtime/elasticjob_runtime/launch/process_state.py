"""What ``/proc`` says about a local process the agent started: stopped, or dying.

The agent decides from these before it hands a round or a launch to a process that
cannot take it: a stopped worker is restarted, not regrouped in place
(:mod:`elasticjob_runtime.launch.hang`); a worker or a warm spare that is dying is
treated as dead before its parent has seen the exit. Under load that gap is long: a
SIGKILLed process closes its sockets at once, then frees its memory, and a SIGKILL sent
to a process waiting for a core is only acted on when it is next scheduled.

The parsers are pure; :func:`stopped_ranks`, :func:`dying_ranks` and :func:`is_dying`
read ``/proc``. A process gone from ``/proc`` (reaped, or no ``/proc``) is neither: its
parent has seen how it ended.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping

# task->flags bit the kernel sets as a thread begins to exit (include/linux/sched.h)
_PF_EXITING = 0x4
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def is_stopped(stat: str) -> bool:
    """State T or t in ``/proc/<pid>/stat``: stopped (SIGSTOP) or traced."""
    try:
        return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")
    except IndexError:
        return False


def is_exiting(stat: str) -> bool:
    """Has the process whose ``/proc/<pid>/stat`` reads ``stat`` begun to die, unseen by
    its parent yet? A zombie, or its main thread past the start of its exit
    (``PF_EXITING``)."""
    try:
        fields = stat.rsplit(")", 1)[1].split()
        state, flags = fields[0], int(fields[6])
    except (IndexError, ValueError):
        return False
    return state in ("Z", "X", "x") or bool(flags & _PF_EXITING)


def kill_pending(status: str) -> bool:
    """Is a SIGKILL queued for the process whose ``/proc/<pid>/status`` reads
    ``status`` (its main thread's pending set, or the process's)? The kernel queues it at
    once; the process begins to exit only when it next runs."""
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name in ("SigPnd", "ShdPnd"):
            try:
                if int(value.strip(), 16) & _SIGKILL_BIT:
                    return True
            except ValueError:
                continue
    return False


def is_stopped_process(pid: int) -> bool:
    stat = _read(f"/proc/{pid}/stat")
    return stat is not None and is_stopped(stat)


def is_dying(pid: int) -> bool:
    """Has ``pid`` begun to die, or been sent a SIGKILL it has not acted on yet?"""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return False
    if is_exiting(stat):
        return True
    status = _read(f"/proc/{pid}/status")
    return status is not None and kill_pending(status)


def _ranks_where(pids: Mapping[int, int], test: Callable[[int], bool]) -> list[int]:
    """The local ranks (``pids``: local rank -> pid) whose process passes ``test``."""
    return sorted(rank for rank, pid in pids.items() if test(pid))


def stopped_ranks(pids: Mapping[int, int]) -> list[int]:
    """The local ranks whose process is stopped (``pids``: local rank -> pid)."""
    return _ranks_where(pids, is_stopped_process)


def dying_ranks(pids: Mapping[int, int]) -> list[int]:
    """The local ranks whose process is dying (``pids``: local rank -> pid).

    A SIGKILLed worker closes its sockets before its agent can reap it: while its other
    threads still free its memory, its peers' collectives fail, a peer's agent opens a
    round, and this agent sees that round before the exit. Handed the round in place,
    the dead worker never takes it (on a 2-core CI run that cost a 5 s stop and a
    second restart). A reaped worker is not listed: the monitor has seen how it ended."""
    return _ranks_where(pids, is_dying)
