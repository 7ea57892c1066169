"""Every private name of torch the runtime depends on, in this one module.

torch's elastic agent has no public extension points: what we change (warm spares,
regrouping in place, not charging restarts for peers that left, an exit barrier that
stops waiting for the dead) lives in its underscored methods and attributes, and its
launcher and agent build their parts through module globals. Everything else in the
runtime uses the public names this module gives them:

* :class:`TorchAgent`: ``LocalElasticAgent`` whose private hooks call public ones
  (``rendezvous``, ``start_workers``, ...; each defaults to torch's own), and whose
  private state is read through properties;
* :func:`starting_workers_with` and :func:`launching_agents_with`: the two module
  globals we replace, each only for as long as torch needs it;
* :class:`HandlerChoosingContext` and :class:`AdoptedProcess`: a ``SubprocessContext``
  that picks each rank's handler, and a handler around a process already running (a
  warm spare);
* :data:`TERMINAL_STATE_SYNC_ID`, :func:`abort_process_group`,
  :func:`forget_failed_group_names` (a build that failed left torch's group counter
  advanced), :func:`forget_unscale` (a ``GradScaler`` whose step was dropped after
  ``unscale_``) and :func:`default_group_on_demand` (a ``torch.distributed`` call before
  the Run built its group builds it).

:data:`PRIVATE_NAMES`, :data:`AGENT_HOOKS` and :data:`AGENT_ATTRIBUTES` list them;
``tests/unit/runtime/test_torch_internals.py`` fails, naming the name, when an installed
torch no longer has one. Written against torch 2.13; CI runs it on the oldest torch
supported (2.11, scripts/oldest-torch.sh) as well.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, Protocol, cast

from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.agent.server import local_elastic_agent
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import PContext, SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

# (module, name): module-level names we read or replace.
PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    ("torch.distributed.elastic.agent.server.api", "_TERMINAL_STATE_SYNC_ID"),
    ("torch.distributed.elastic.agent.server.local_elastic_agent", "start_processes"),
    ("torch.distributed.launcher.api", "LocalElasticAgent"),
    ("torch.distributed.distributed_c10d", "_abort_process_group"),
    ("torch.distributed.distributed_c10d", "_world"),
    ("torch.distributed.distributed_c10d", "_get_default_group"),
)
# LocalElasticAgent's methods we override or call, with their parameters after self.
AGENT_HOOKS: dict[str, tuple[str, ...]] = {
    "_rendezvous": ("worker_group",),
    "_start_workers": ("worker_group",),
    "_stop_workers": ("worker_group",),
    "_monitor_workers": ("worker_group",),
    "_restart_workers": ("worker_group",),
    "_initialize_workers": ("worker_group",),
    "_exit_barrier": (),
}
# LocalElasticAgent's instance attributes we read or set.
AGENT_ATTRIBUTES = (
    "_pcontext",
    "_worker_group",
    "_remaining_restarts",
    "_store",
    "_exit_barrier_timeout",
)
# LocalElasticAgent's instance attributes we set for torch's own health check to read,
# with the first torch that has them: an older agent neither has nor reads one, and
# setting it there changes nothing.
AGENT_SIGNALS: dict[str, str] = {"_in_exit_barrier": "2.12"}
# SubprocessContext's start and close hooks, and what SubprocessHandler.close() reads.
CONTEXT_HOOKS = ("_start", "_close")
HANDLER_ATTRIBUTES = ("_stdout", "_stderr")

TERMINAL_STATE_SYNC_ID: str = agent_api._TERMINAL_STATE_SYNC_ID


class TorchAgent(LocalElasticAgent):
    """torch's ``LocalElasticAgent`` with its private hooks under public names.

    torch's loop calls ``_rendezvous`` and the rest; each calls the public method of the
    same name, whose default is torch's own. A subclass overrides the public one and
    calls ``super()`` for torch's behaviour.
    """

    # -- the hooks torch's loop calls

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        self.rendezvous(worker_group)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        return self.start_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self.stop_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        return self.monitor_workers(worker_group)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self.restart_workers(worker_group)

    def _exit_barrier(self) -> None:
        self.exit_barrier()

    # -- their public names, torch's behaviour by default

    def rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)

    def start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        started: dict[int, Any] = super()._start_workers(worker_group)
        return started

    def stop_workers(self, worker_group: WorkerGroup) -> None:
        super()._stop_workers(worker_group)

    def monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result: RunResult = super()._monitor_workers(worker_group)
        return result

    def restart_workers(self, worker_group: WorkerGroup) -> None:
        super()._restart_workers(worker_group)

    def exit_barrier(self) -> None:
        super()._exit_barrier()  # type: ignore[no-untyped-call]

    def initialize_workers(self, worker_group: WorkerGroup) -> None:
        """torch's round: rendezvous, then start the workers (through the hooks above)."""
        self._initialize_workers(worker_group)

    # -- torch's private state, read-only unless named otherwise

    @property
    def workers_context(self) -> PContext | None:
        """The running workers' processes (None before the first start)."""
        context: PContext | None = self._pcontext
        return context

    def worker_pids(self) -> dict[int, int]:
        """Local rank -> pid of the running workers."""
        return self._pcontext.pids() if self._pcontext is not None else {}

    @property
    def worker_group(self) -> WorkerGroup:
        return self._worker_group

    @property
    def rendezvous_store(self) -> Any:
        """The store of the current round (None before the first rendezvous)."""
        return self._store

    @property
    def exit_barrier_timeout(self) -> float:
        return float(self._exit_barrier_timeout)

    def stop_restarting(self) -> None:
        """No restart left: the next failure ends the run."""
        self._remaining_restarts = 0

    @contextlib.contextmanager
    def in_exit_barrier(self) -> Iterator[None]:
        """Tell torch's health check the agent waits in the exit barrier."""
        self._in_exit_barrier = True
        try:
            yield
        finally:
            self._in_exit_barrier = False


@contextlib.contextmanager
def _replaced(module: ModuleType, name: str, value: Any) -> Iterator[Any]:
    """``module.name`` is ``value`` inside the block (the original is yielded)."""
    original = vars(module)[name]
    setattr(module, name, value)
    try:
        yield original
    finally:
        setattr(module, name, original)


def starting_workers_with(
    start: Callable[..., PContext],
) -> contextlib.AbstractContextManager[Callable[..., PContext]]:
    """While torch's agent starts a round's workers, it calls ``start`` instead of its
    ``start_processes`` (given back, for ``start`` to fall through to)."""
    return _replaced(local_elastic_agent, "start_processes", start)


def launching_agents_with(
    factory: Callable[..., LocalElasticAgent],
) -> contextlib.AbstractContextManager[Any]:
    """While torch's launcher runs, it builds its agent with ``factory``."""
    import torch.distributed.launcher.api as launcher_api

    return _replaced(launcher_api, "LocalElasticAgent", factory)


def abort_process_group() -> None:
    """Abort the default process group's pending collectives (NCCL only in torch)."""
    import torch.distributed as dist

    dist.distributed_c10d._abort_process_group()


def forget_failed_group_names() -> None:
    """Name the next default process group "0", as every peer names theirs.

    ``init_process_group`` names its group from a counter it advances *before* building
    it, and only destroying a built default group resets that counter. A build that
    failed (a peer died while gloo connected its mesh) leaves it at 1, so the next
    round's group would be "1" and would put its keys under ``1/`` while its peers read
    ``0/``: every member waits for the others' addresses until the group's timeout (the
    in-place hang of issue 36). Does nothing while a default group stands."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.distributed_c10d._world.group_count = 0


def default_group_on_demand(build: Callable[[], None]) -> Callable[[], None]:
    """Until the returned function is called, a ``torch.distributed`` call that needs the
    default group while none stands calls ``build()`` first, then goes on as torch's.

    torch has no hook for it: its functions fetch the default group through the module
    function ``_get_default_group``, which raises when there is none; this replaces that
    function for the while (``dist.is_initialized()`` still says False meanwhile). The
    replacement takes itself out before it builds, so a build that asks for the group
    sees torch's own."""
    import torch.distributed.distributed_c10d as c10d

    original = c10d._get_default_group

    def restore() -> None:
        if c10d._get_default_group is on_demand:
            c10d._get_default_group = original

    def on_demand() -> Any:
        restore()
        if not c10d.is_initialized():
            build()
        return original()

    c10d._get_default_group = on_demand
    return restore


def forget_unscale(scaler: Any) -> None:
    """Forget that ``unscale_`` ran on a ``GradScaler``'s optimizers since its last
    ``update()``: a step dropped between the two (its group broke in the optimizer's
    step, where the switch vote is counted) is retried from the start, and its
    ``unscale_`` would otherwise raise "unscale_() has already been called". The scale
    itself is the step's state, restored with the rest; this per-step record is not in
    the scaler's ``state_dict``, and torch resets it only in ``update()``."""
    scaler._per_optimizer_states.clear()  # a defaultdict: each optimizer starts afresh


class HandlerChoosingContext(SubprocessContext):
    """torch's ``SubprocessContext``, whose start asks :meth:`start_handlers` for each
    rank's handler instead of starting a process per rank itself."""

    def _start(self) -> None:
        if self.subprocess_handlers:
            raise ValueError("the workers were already started")
        self.subprocess_handlers = self.start_handlers()

    def start_handlers(self) -> dict[int, SubprocessHandler]:
        raise NotImplementedError

    def _close(self, death_sig: signal.Signals, timeout: int = 30) -> None:
        """torch's close (the stop signal to each worker, a wait, SIGKILL to those
        still there), then SIGKILL to whatever of each worker's process group outlived it:
        a worker is stopped alone (:meth:`AdoptedProcess.close`), and its DataLoader
        workers must not outlive the agent."""
        super()._close(death_sig, timeout)
        for handler in self.subprocess_handlers.values():
            if handler.proc.poll() is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(handler.proc.pid, signal.SIGKILL)


class WorkerProcess(Protocol):
    """What torch's handler uses of its ``Popen``: a spare forked from the template
    (spare_template.ForkedProcess) has the same, built on its template's reports."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...


class AdoptedProcess(SubprocessHandler):
    """torch's handler around a process that already runs: torch opens the worker's log
    files and keeps them until ``close()``, as for a process it started; ``proc`` is
    the adopted one, so exit codes, signals and shutdown are torch's own code."""

    def __init__(
        self,
        proc: WorkerProcess,
        stdout: str | None,
        stderr: str | None,
        local_rank_id: int,
    ) -> None:
        self._stdout = open(stdout, "w") if stdout else None  # noqa: SIM115
        self._stderr = open(stderr, "w") if stderr else None  # noqa: SIM115
        self.local_rank_id = local_rank_id
        self.proc = cast("subprocess.Popen[bytes]", proc)  # torch types it so; see WorkerProcess

    @classmethod
    def taking_over(cls, handler: SubprocessHandler) -> AdoptedProcess:
        """torch's own handler for a worker it started cold, stopped as :meth:`close` says."""
        adopted = cls.__new__(cls)
        adopted._stdout, adopted._stderr = handler._stdout, handler._stderr
        adopted.local_rank_id, adopted.proc = handler.local_rank_id, handler.proc
        return adopted

    def close(self, death_sig: signal.Signals | None = None) -> None:
        """A stop asked for (SIGTERM) goes to the worker alone; SIGKILL to its whole
        process group, as torch sends both. The worker saves its last step at its next
        step boundary (a sharded model's ranks first agree on one, a step later), and
        its DataLoader workers must live until then: killed by torch's group-wide
        SIGTERM, they broke the worker's loop before it got there. They exit with it."""
        sig = death_sig or signal.SIGTERM
        if sig == signal.SIGKILL:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        for f in (self._stdout, self._stderr):
            if f:
                f.close()

    @property
    def stdout_file(self) -> Any:
        return self._stdout

    @property
    def stderr_file(self) -> Any:
        return self._stderr
