"""The agent's warm spares: one per local rank (or fewer), handed each round's launch.

torch's agent starts a round's workers through ``start_processes``, which builds a
``SubprocessContext`` of one ``SubprocessHandler`` (a ``Popen``) per local rank.
:class:`WarmSubprocessContext` is that context with one change: where a live spare
waits for the rank, the handler adopts the spare's process and sends it the
launch (:mod:`elasticjob_runtime.launch.spare`) instead of starting a new one. Everything
downstream is torch's own code on a real ``Popen``: polling exit codes, error files,
tee, SIGTERM then SIGKILL after the shutdown timeout. Once the round that took spares
trains (:func:`refill_due`), the pool starts fresh ones, which warm up while it trains:
not at the hand-over itself, where a fresh interpreter importing torch would take CPU
from the workers' own start-up (the model, DDP, the checkpoint, the first step).

A spare is used only if the worker would have started with the same environment apart
from the per-round variables (:data:`ROUND_VARIABLES`); anything else that differs
could have been read at import time, so that rank starts cold and the pool renews its
spares. The pool is off for ``--no-python`` and interpreter flags other than ``-u``.

Spares are forked from a warm template (:mod:`elasticjob_runtime.launch.spare_template`)
where it can: a refill then costs milliseconds, not a fresh interpreter's imports on
the cores the training fills, so the pool refills as soon as a round takes its spares.
Without the template (``--no-warm-spare-fork``, or once it failed) each spare is a
fresh interpreter that imports torch itself (about 360 MiB of its own,
docs/recovery.md), refilled only once the round trains. So a pool may keep fewer than
one per local rank (``--warm-spare-count``): the spares are not tied to ranks, the
lowest ranks take them and the others start cold.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.elastic.multiprocessing import start_processes
from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import (
    SubprocessHandler,
    get_subprocess_handler,
)

from elasticjob_runtime import contract
from elasticjob_runtime.launch.process_state import is_dying
from elasticjob_runtime.launch.spare import WARM, Target, WorkerLaunch, send_launch, spare_env
from elasticjob_runtime.launch.spare_template import ForkedProcess, become_subreaper, fork_spare
from elasticjob_runtime.launch.torch_internals import AdoptedProcess, HandlerChoosingContext

log = logging.getLogger(__name__)

# What torch's agent sets per worker and round (local_elastic_agent._start_workers and
# the log destinations): read at run time by torch.distributed, never at import.
ROUND_VARIABLES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        contract.ROUND_ID,
        contract.ROUND_CAUSE,
    }
)
ROUND_PREFIXES = ("TORCHELASTIC_",)
STOP_TIMEOUT_S = 5.0
# Spares taken by a round are replaced at its first step, or this long after the
# hand-over for a script that reports no steps (a script of its own, run unchanged).
REFILL_DELAY_S = 5.0
# ... and at most this long for workers that report their steps (refill_due).
REFILL_LIMIT_S = 60.0


def refill_due(
    handed_at: float | None, stepped: bool, now: float, delay: float, reports_steps: bool = False
) -> bool:
    """Is it time to replace the spares a round took at ``handed_at`` (None: none taken
    since the last refill)? Once the round trains (``stepped``: a step reported since),
    or ``delay`` after the hand-over, whichever comes first. A second fault before then
    starts its workers cold: the price of not slowing every restart.

    Workers that report their steps (``reports_steps``: they offered to regroup in place,
    so they run the Run's loop) are waited for up to :data:`REFILL_LIMIT_S` instead: a
    joiner's first step comes after its peers' regroup and a cold first step, and a
    spare importing torch on the same cores at the fifth second slowed that step's
    optimizer from 0.2 to 0.66 s (an FSDP2 join on two cores)."""
    if handed_at is None:
        return False
    return stepped or now - handed_at >= (REFILL_LIMIT_S if reports_steps else delay)


def spare_count(requested: int | None, local_world_size: int) -> int:
    """How many spares a pool keeps: one per local rank unless fewer are asked for. More
    would never be used: a round starts at most one worker per local rank."""
    if requested is None:
        return local_world_size
    return max(0, min(requested, local_world_size))


def is_round_variable(name: str) -> bool:
    return name in ROUND_VARIABLES or name.startswith(ROUND_PREFIXES)


def env_differences(spare_env: Mapping[str, str], worker_env: Mapping[str, str]) -> list[str]:
    """Names outside the per-round set whose values differ: a reason to start cold."""
    names = (set(spare_env) | set(worker_env)) - {n for n in worker_env if is_round_variable(n)}
    names -= {n for n in spare_env if is_round_variable(n)}
    return sorted(n for n in names if spare_env.get(n) != worker_env.get(n))


@dataclass
class Spare:
    """A started spare: its process and the agent's end of its socket."""

    proc: subprocess.Popen[bytes] | ForkedProcess
    sock: socket.socket
    env: dict[str, str]
    warm: bool = False  # it said its imports are done

    def alive(self) -> bool:
        """Not exited, and not dying either: a spare SIGKILLed with its worker (a node's
        processes killed together) is not yet reaped when the agent takes it for the
        restart, and a worker launched into it would die at once, a second restart."""
        return self.proc.poll() is None and not is_dying(self.proc.pid)

    def stop(self) -> None:
        """Stop an idle spare: EOF on its socket, then SIGKILL its session."""
        self.sock.close()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(STOP_TIMEOUT_S)


@dataclass
class SparePool:
    """Warm spares for ``target``, one per local rank or ``size`` (:func:`spare_count`);
    see the module docstring."""

    target: Target
    local_world_size: int
    python: str = sys.executable
    warm_imports: tuple[str, ...] = ()
    size: int | None = None  # None: one per local rank
    fork: bool = True  # fork spares from a warm template (off: each starts cold)
    spares: dict[int, Spare] = field(default_factory=dict)  # by slot, 0..capacity-1
    template: Spare | None = None  # the warm interpreter spares are forked from
    handed_over: int = 0
    started_cold: int = 0

    @property
    def capacity(self) -> int:
        return spare_count(self.size, self.local_world_size)

    def forks(self) -> bool:
        """Are spares forked from a warm template (so a refill costs no imports)?"""
        return self.template is not None and self.template.warm and self.template.alive()

    def fill(self) -> None:
        """A spare in every slot that has none: forked from the template once it is warm
        (until then the slots wait, :meth:`wait_warm`), else started as an interpreter
        of its own (they warm up concurrently)."""
        self._keep_template()
        for slot in range(self.capacity):
            spare = self.spares.get(slot)
            if spare is not None and spare.alive():
                continue
            if spare is not None:
                spare.stop()
                del self.spares[slot]
            if self.template is not None and not self.template.warm:
                continue  # still importing: wait_warm forks these
            self.spares[slot] = self._fork() if self.template is not None else self._start()

    def _keep_template(self) -> None:
        """Start the template, or a new one for an environment that changed since (its
        forks would all start cold); give up forking if it died."""
        if not self.fork:
            return
        if self.template is not None and not self.template.alive():
            log.warning(
                "the warm spare template exited (code %s); spares now start as fresh interpreters",
                self.template.proc.returncode,
            )
            self.template.stop()
            self.template, self.fork = None, False
            return
        if self.template is not None and env_differences(self.template.env, os.environ):
            self.template.stop()
            self.template = None
        if self.template is None:
            if not become_subreaper():
                log.warning(
                    "cannot adopt forked spares (no PR_SET_CHILD_SUBREAPER); spares "
                    "start as fresh interpreters"
                )
                self.fork = False
                return
            self.template = self._start(template=True)

    def _fork(self) -> Spare:
        """A spare forked from the template; a fresh interpreter if the template fails
        (it is then given up: every later spare starts as its own interpreter)."""
        template = self.template
        assert template is not None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = fork_spare(template.sock, theirs)
        finally:
            theirs.close()
        if proc is not None:
            return Spare(proc, ours, template.env)
        ours.close()
        log.warning("the warm spare template did not fork; spares now start as fresh interpreters")
        template.stop()
        self.template, self.fork = None, False
        return self._start()

    def _start(self, template: bool = False) -> Spare:
        """A spare that is an interpreter of its own, or (``template``) the template."""
        env = dict(os.environ)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [
            self.python,
            *self.target.flags,
            "-m",
            "elasticjob_runtime.launch.spare",
            f"--fd={theirs.fileno()}",
            f"--parent={os.getpid()}",
            *(["--template"] if template else []),
        ]
        try:
            proc = subprocess.Popen(
                cmd,
                env={**env, **spare_env(self.target, self.warm_imports)},
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        finally:
            theirs.close()
        return Spare(proc, ours, env)

    def wait_warm(self, timeout: float) -> bool:
        """Wait until every spare has done its imports (or died); False on timeout.

        A new agent calls this before it first joins a round, so a running group pauses
        only for the switch, not for the newcomer's imports. With a template, that is
        the template's imports, then the forks (warm at once).
        """
        deadline = time.monotonic() + timeout
        if self.template is not None and not self.template.warm:
            if not _await_warm([self.template], deadline):
                return False
            self.fill()  # forks into the empty slots, or starts cold if the template died
        return _await_warm(list(self.spares.values()), deadline)

    def take(self, local_rank: int, worker_env: Mapping[str, str]) -> Spare | None:
        """A spare for ``local_rank`` (the lowest slot's) if it is alive and fits
        ``worker_env``; it leaves the pool. None: the rank starts cold."""
        if not self.spares:
            return None
        spare = self.spares.pop(min(self.spares))
        if not spare.alive():
            log.warning(
                "warm spare for local rank %d %s; starting the worker cold",
                local_rank,
                "is dying"
                if spare.proc.returncode is None
                else f"exited (code {spare.proc.returncode})",
            )
            spare.stop()
            return None
        differs = env_differences(spare.env, worker_env)
        if differs:
            log.info(
                "environment changed since the spare started (%s); starting the worker cold",
                ", ".join(differs),
            )
            spare.stop()
            return None
        return spare

    def close(self) -> None:
        for spare in self.spares.values():
            spare.stop()
        self.spares.clear()
        if self.template is not None:
            self.template.stop()
            self.template = None


def _await_warm(spares: list[Spare], deadline: float) -> bool:
    """Until each of ``spares`` has said it is warm (or died); False at ``deadline``."""
    waiting = {s.sock: s for s in spares if not s.warm}
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        readable, _, _ = select.select(list(waiting), [], [], min(left, 1.0))
        for sock in readable:
            spare = waiting.pop(sock)
            with contextlib.suppress(OSError):
                spare.warm = sock.recv(1) == WARM  # b"" : the spare died
        for sock, spare in list(waiting.items()):
            if not spare.alive():
                del waiting[sock]
    return True


class SpareHandler(AdoptedProcess):
    """torch's handler around a spare's process: the spare becomes the worker."""

    def __init__(
        self,
        spare: Spare,
        args: Sequence[str],
        env: dict[str, str],
        stdout: str | None,
        stderr: str | None,
        local_rank_id: int,
    ) -> None:
        super().__init__(spare.proc, stdout, stderr, local_rank_id)
        logs = [f for f in (self.stdout_file, self.stderr_file) if f is not None]
        launch = WorkerLaunch(
            [str(a) for a in args], env, self.stdout_file is not None, self.stderr_file is not None
        )
        fds = [f.fileno() for f in logs]
        try:
            send_launch(spare.sock, launch, fds)
        finally:
            spare.sock.close()


class WarmSubprocessContext(HandlerChoosingContext):
    """``SubprocessContext`` whose ranks start from the pool's spares where it can."""

    def __init__(self, pool: SparePool | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._pool = pool  # None: no spares, every worker started cold

    def start_handlers(self) -> dict[int, SubprocessHandler]:
        handlers: dict[int, SubprocessHandler] = {}
        for rank in range(self.nprocs):
            env = {**os.environ, **self.envs[rank]}
            spare = self._pool.take(rank, env) if self._pool is not None else None
            if spare is None:
                if self._pool is not None:
                    self._pool.started_cold += 1
                started = get_subprocess_handler(
                    entrypoint=self.entrypoint,  # type: ignore[arg-type]
                    args=self.args[rank],
                    env=self.envs[rank],
                    stdout=self.stdouts[rank],
                    stderr=self.stderrs[rank],
                    local_rank_id=rank,
                )
                handlers[rank] = AdoptedProcess.taking_over(started)  # its polite stop
                continue
            assert self._pool is not None  # a spare came from it
            self._pool.handed_over += 1
            handlers[rank] = SpareHandler(
                spare, self.args[rank], env, self.stdouts[rank], self.stderrs[rank], rank
            )
        return handlers  # the agent refills the pool (refill_due)


def start_processes_warm(pool: SparePool | None, **kwargs: Any) -> PContext:
    """torch's ``start_processes`` for binaries, with :class:`WarmSubprocessContext`
    (``pool`` None: no spares; the workers still get its handlers' stop, AdoptedProcess)."""
    if not isinstance(kwargs.get("entrypoint"), str) or kwargs.get("numa_options"):
        return start_processes(**kwargs)
    kwargs.pop("start_method", None)
    context = WarmSubprocessContext(pool, **kwargs)
    try:
        context.start()
    except Exception:
        context.close()
        raise
    return context
