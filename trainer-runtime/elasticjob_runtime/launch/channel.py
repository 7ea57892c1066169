"""The files through which ``elasticjob-run``'s agent and its workers talk about rounds.

The agent owns a directory (named to its workers by ``ELASTICJOB_AGENT_CHANNEL``).
For every round it writes each local rank's *assignment*: the environment torch's
agent gives a worker for that round (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...) and a
generation number that grows with every round this agent delivers. A worker that was
started for the round reads it once; a worker that regroups in place (the training-loop
API in :mod:`elasticjob_runtime.training.run`) keeps running across rounds and waits here
for a newer generation instead of exiting.

Workers write these back:

* ``in-place-<local rank>``: its pid, once it can regroup in place. The agent keeps a
  healthy worker across a membership change only when every local worker said so.
* ``regroup-<local rank>``: the generation in which its collective failed. The agent
  opens a new round for it (a peer's failure that changed no membership still ends
  the round for everyone).
* ``taken-<local rank>``: the generation of the last round it took in place. An offer
  to regroup in place outlives a worker that froze after making it; a round it never
  takes is a hang (the agent restarts it: :mod:`elasticjob_runtime.launch.hang`).
* ``finished-<local rank>``: its training is over and it is about to exit.
* ``fatal-<local rank>``: why it is about to fail in a way a restart would repeat (the
  ranks trained different models: fingerprint.py); the agent then fails instead of
  restarting its workers from a checkpoint into the same bug.
* ``bell-<local rank>``: a FIFO its round watcher waits on; the agent writes a byte to
  it after every delivery, so the watcher wakes at once instead of polling (it still
  looks once a second, so a lost ring costs at most that).
* ``agent-bell``: the agent's FIFO; a worker writes a byte to it after each of the
  files above but its step (:meth:`WorkerChannel.request_regroup` and the rest), so the
  agent's monitor pass comes at once instead of at its interval
  (:mod:`elasticjob_runtime.launch.monitor_wake`).
* ``step-<local rank>``: the last step it completed (:class:`StepReporter`). The agent
  reads them once per monitor pass for all its readers: the hang clock (hang.py) and the
  refill of the spares the round took (spare_pool.py).

When its node is leaving (a SIGTERM, rendezvous/departure.py) and the other nodes have
sealed a round without it, the agent writes ``handed-over``: the workers go on training in
their old round, vote in their next step to end it (training/switch_vote.py), and at that
step's end, where every rank of the round leaves it, exit without saving, since the
others hold the same state.

And the agent writes ``group-broken`` before it stops workers whose round lost a peer:
their step in flight sits in a collective that can never finish, so the checkpoint's
SIGTERM path saves the last completed step at once (:func:`group_broken`) instead of
waiting its grace for a step boundary.

This directory, named by the one variable ``ELASTICJOB_AGENT_CHANNEL``, holds every
file between an agent and its workers; this module is the only one that names them.
The directory's own name carries its agent's pid namespace and pid
(:func:`new_channel_dir`): an agent removes its directory when it returns, one that was
SIGKILLed cannot, and the next agent on the host removes those whose agent is gone
(:func:`sweep_abandoned`; about 230 were left in /tmp by one run of the test suite).

Training ends while peers may still come and go, and a round this agent forms for its
workers must be one they build, or its other members wait in it until their group's
timeout. So the agent marks a regroup in place it starts (``regrouping``) and the
worker marks its end (``finished-<local rank>``); each writes its mark, then reads the
other's. Whichever reads second sees the first: an agent that sees a worker finished
does not regroup in place (it restarts its workers into the round, and they resume from
the final checkpoint); a finishing worker that sees a regroup under way waits for it
and builds the round before it exits.

Files are written whole (a temporary file renamed over the old one) and read when
looked at: a ``stat`` costs nothing beside a training step, and unlike a pipe the
channel needs no descriptor that survives torch's process start-up and warm spares (the
bell is a FIFO opened by name, by the worker itself).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from elasticjob_runtime import contract

POLL_S = 0.01
REGROUPING = "regrouping"  # the agent is forming the next round for its workers
GROUP_BROKEN = "group-broken"  # the agent stops workers whose round lost a peer
HANDED_OVER = "handed-over"  # this node left the job; its peers went on without it
STEP_WIDTH = 20  # digits of a step file, rewritten in place
BELL = "bell"  # bell-<local rank>: the FIFO a worker's round watcher waits on
AGENT_BELL = "agent-bell"  # the FIFO the agent's monitor wait includes
DIR_PREFIX = "elasticjob-agent-"  # <pid namespace>-<pid>-<random>: new_channel_dir
_OWNED_DIR = re.compile(rf"^{re.escape(DIR_PREFIX)}(\d+)-(\d+)-")


@dataclass(frozen=True)
class Assignment:
    """One local rank's part in one round, as the agent delivered it."""

    generation: int
    env: dict[str, str]
    # The round this replaces lost a peer: its collectives can never finish, so a worker
    # abandons them at once instead of at its next step boundary.
    abort: bool = False

    @property
    def rank(self) -> int:
        return int(self.env["RANK"])

    @property
    def world_size(self) -> int:
        return int(self.env["WORLD_SIZE"])

    @property
    def master(self) -> tuple[str, int]:
        return self.env["MASTER_ADDR"], int(self.env["MASTER_PORT"])

    def store_prefix(self) -> str:
        """A key prefix only this round's members share: its rank-0 endpoint is chosen
        afresh each round, and the generation-independent form lets a worker started for
        the round and a worker regrouping into it agree without asking anyone."""
        host, port = self.master
        return f"elasticjob/round/{host}:{port}/"

    def to_json(self) -> str:
        return json.dumps({"generation": self.generation, "abort": self.abort, "env": self.env})

    @classmethod
    def from_json(cls, text: str) -> Assignment:
        raw = json.loads(text)
        env = {str(k): str(v) for k, v in dict(raw["env"]).items()}
        return cls(int(raw["generation"]), env, bool(raw.get("abort", False)))


def _write_whole(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class AgentChannel:
    """The agent's side: deliver assignments, read who can regroup and who asks to."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def deliver(self, generation: int, envs: Mapping[int, Mapping[str, str]], abort: bool) -> None:
        for local_rank, env in envs.items():
            assignment = Assignment(generation, {k: str(v) for k, v in env.items()}, abort)
            _write_whole(self.directory / f"assignment-{local_rank}.json", assignment.to_json())
        for local_rank in envs:
            ring(self.directory / f"{BELL}-{local_rank}")

    def bell(self) -> int | None:
        """A descriptor that becomes readable when a worker wrote one of its files (drain
        it), or None where no FIFO can be made (the monitor pass then comes at its
        interval alone)."""
        return open_fifo(self.directory / AGENT_BELL)

    def in_place_pids(self) -> dict[int, int]:
        """Local rank -> pid of each worker that said it can regroup in place."""
        out: dict[int, int] = {}
        for path in self.directory.glob("in-place-*"):
            try:
                out[int(path.name.rsplit("-", 1)[1])] = int(path.read_text())
            except (OSError, ValueError):
                continue
        return out

    def regroup_requested(self, generation: int) -> bool:
        """Did a worker's collective fail in ``generation`` (the round now running)?"""
        return any(asked >= generation for asked in self.regroup_requests().values())

    def regroup_requests(self) -> dict[int, int]:
        """Local rank -> the generation in which its worker last asked for a new round."""
        return self._generations("regroup-*")

    def taken(self) -> dict[int, int]:
        """Local rank -> the generation of the last round its worker took in place."""
        return self._generations("taken-*")

    def _generations(self, pattern: str) -> dict[int, int]:
        out: dict[int, int] = {}
        for path in self.directory.glob(pattern):
            try:
                out[int(path.name.rsplit("-", 1)[1])] = int(path.read_text())
            except (OSError, ValueError):
                continue
        return out

    def fatal(self) -> str | None:
        """A worker's word that its failure must not be restarted, or None."""
        for path in sorted(self.directory.glob("fatal-*")):
            try:
                return path.read_text()
            except OSError:
                continue
        return None

    def steps(self) -> dict[int, int]:
        """Local rank -> the step its worker last reported."""
        out: dict[int, int] = {}
        for path in self.directory.glob("step-*"):
            try:
                out[int(path.name[len("step-") :])] = int(path.read_text())
            except (OSError, ValueError):
                continue
        return out

    def forget_workers(self) -> None:
        """Workers are being replaced: their offers to regroup in place, the rounds they
        took, their word that they finished and the steps they reported end with them."""
        for pattern in ("in-place-*", "taken-*", "finished-*", "step-*"):
            for path in self.directory.glob(pattern):
                path.unlink(missing_ok=True)

    def mark_group_broken(self) -> None:
        """The workers about to be stopped lost a peer: they save without waiting."""
        (self.directory / GROUP_BROKEN).touch()

    def hand_over(self) -> None:
        """The workers' peers went on without this node: they vote to end the old round
        and leave at the step boundary it ends (training/switch_vote.py)."""
        (self.directory / HANDED_OVER).touch()

    def clear_group_broken(self) -> None:
        (self.directory / GROUP_BROKEN).unlink(missing_ok=True)

    def begin_regroup(self) -> bool:
        """Mark a regroup in place as under way, unless a worker already said it finished
        (False: it may be gone before the round stands; restart the workers instead)."""
        self._regrouping.write_text("")
        if any(self.directory.glob("finished-*")):
            self._regrouping.unlink(missing_ok=True)
            return False
        return True

    def end_regroup(self) -> None:
        """The round is delivered (or could not be formed): finishing workers may go."""
        self._regrouping.unlink(missing_ok=True)

    @property
    def _regrouping(self) -> Path:
        return self.directory / REGROUPING


class WorkerChannel:
    """A worker's side, for one local rank."""

    def __init__(self, directory: Path, local_rank: int) -> None:
        self.directory = directory
        self.local_rank = local_rank
        self._assignment = directory / f"assignment-{local_rank}.json"
        self._seen: tuple[int, int] | None = None
        self._latest: Assignment | None = None

    @classmethod
    def from_env(cls) -> WorkerChannel | None:
        """None outside ``elasticjob-run`` (plain torchrun, or no launcher at all)."""
        found = _local_rank_from_env()
        return cls(*found) if found is not None else None

    def latest(self) -> Assignment | None:
        """The newest assignment (re-read only when the file changed: one ``stat``)."""
        try:
            st = self._assignment.stat()
        except FileNotFoundError:
            return None
        key = (st.st_mtime_ns, st.st_ino)
        if key != self._seen:
            try:
                self._latest = Assignment.from_json(self._assignment.read_text())
            except (OSError, ValueError, KeyError):
                return self._latest  # replaced under us: the next poll reads the new one
            self._seen = key
        return self._latest

    def wait_newer(self, generation: int, timeout: float) -> Assignment | None:
        """The first assignment newer than ``generation``, or None after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.latest()
            if found is not None and found.generation > generation:
                return found
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)

    def bell(self) -> int | None:
        """A descriptor that becomes readable when the agent delivers a round (drain it
        with :func:`~elasticjob_runtime.launch.wakeup.drain`), or None where no FIFO can be
        made (the caller polls). Opened read-write, so it never reads as end-of-file."""
        return open_fifo(self.directory / f"{BELL}-{self.local_rank}")

    def _tell_agent(self, name: str, text: str) -> None:
        """Write a file for the agent and ring its bell, so it reads it now."""
        _write_whole(self.directory / f"{name}-{self.local_rank}", text)
        ring(self.directory / AGENT_BELL)

    def offer_in_place(self) -> None:
        self._tell_agent("in-place", str(os.getpid()))

    def request_regroup(self, generation: int) -> None:
        self._tell_agent("regroup", str(generation))

    def say_taken(self, generation: int) -> None:
        """This worker takes round ``generation``: the agent restarts a worker that does
        not take a round it was handed in place (hang.py)."""
        with contextlib.suppress(OSError):  # the agent is gone: nobody to tell
            self._tell_agent("taken", str(generation))

    def say_finished(self) -> None:
        self._tell_agent("finished", str(os.getpid()))

    def say_fatal(self, message: str) -> None:
        self._tell_agent("fatal", message)

    def handed_over(self) -> bool:
        """Has this node left the job, its peers having gone on without it?"""
        return (self.directory / HANDED_OVER).exists()

    def agent_regrouping(self) -> bool:
        """Is the agent forming a round this worker was offered for?"""
        return (self.directory / REGROUPING).exists()


def open_fifo(path: Path) -> int | None:
    """The FIFO at ``path`` (made if missing), opened read-write so it never reads as
    end-of-file, non-blocking; None where no FIFO can be made."""
    try:
        with contextlib.suppress(FileExistsError):
            os.mkfifo(path, 0o600)
        return os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None


def ring(path: Path) -> None:
    """Write a byte to the FIFO at ``path`` if a worker holds it open; never blocks."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # no FIFO yet (ENOENT), or nobody reading it (ENXIO): nobody to wake
        return
    try:
        os.write(fd, b"!")
    except OSError:  # full (EAGAIN): a ring is pending already
        pass
    finally:
        os.close(fd)


def new_channel_dir() -> Path:
    """A new, private channel directory for this agent, named by its pid namespace and
    pid, so the next agent on the host can tell it was abandoned (:func:`sweep_abandoned`)."""
    return Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{pid_namespace()}-{os.getpid()}-"))


def pid_namespace() -> int:
    """This process's pid namespace (0 where /proc does not say): a pid means a process
    only within it, and containers that share /tmp may each have their own."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def abandoned(names: Iterable[str], namespace: int, alive: Callable[[int], bool]) -> list[str]:
    """The channel directories among ``names`` whose agent, of this pid ``namespace``, is
    gone. A name of another namespace, or of no known shape, is never one."""
    out = []
    for name in names:
        found = _OWNED_DIR.match(name)
        if found is None or int(found.group(1)) != namespace:
            continue
        if not alive(int(found.group(2))):
            out.append(name)
    return out


def sweep_abandoned(parent: Path | None = None) -> list[str]:
    """Remove the channel directories that agents killed on this host left behind (an
    agent removes its own when it returns; one that was SIGKILLed cannot); returns their
    names. A reused pid keeps its directory until that process is gone too: a leak
    delayed, never a live agent's directory removed."""
    where = parent if parent is not None else Path(tempfile.gettempdir())
    names = [path.name for path in where.glob(f"{DIR_PREFIX}*")]
    gone = abandoned(names, pid_namespace(), _alive)
    for name in gone:
        shutil.rmtree(where / name, ignore_errors=True)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _directory_from_env() -> Path | None:
    directory = os.environ.get(contract.AGENT_CHANNEL)
    return Path(directory) if directory else None


def _local_rank_from_env() -> tuple[Path, int] | None:
    """This worker's channel directory and local rank, or None without an agent's."""
    directory = _directory_from_env()
    if directory is None or not directory.is_dir():
        return None
    return directory, int(os.environ.get("LOCAL_RANK", "0"))


def group_broken() -> bool:
    """True when this worker's agent is stopping it because its round lost a peer: a
    collective in flight can then never finish, so waiting for a step boundary is moot."""
    directory = _directory_from_env()
    return directory is not None and (directory / GROUP_BROKEN).exists()


class StepReporter:
    """A worker's latest step in ``step-<local rank>`` of the agent channel.

    One ``pwrite`` of a fixed-width number into the page cache per step (about a
    microsecond, no fsync): the agent reads the very last step, so the record of a hang
    names the step the group stopped after.
    """

    def __init__(self, directory: Path, local_rank: int) -> None:
        self.path = directory / f"step-{local_rank}"
        self._fd: int | None = None

    def report(self, step: int) -> None:
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
            os.pwrite(self._fd, f"{step:>{STEP_WIDTH}}".encode(), 0)
        except OSError:  # the agent went away (its directory with it): nobody to tell
            pass

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @classmethod
    def from_env(cls) -> StepReporter | None:
        """None outside ``elasticjob-run`` (nobody watches the steps there)."""
        found = _local_rank_from_env()
        return cls(*found) if found is not None else None
