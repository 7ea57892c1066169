"""The training-loop API: a DDP script made elastic in about ten lines, recovering in place.

A plain DDP loop, and the same loop with this API (docs/training-loop.md has the diff)::

    run = elastic.Run(checkpoint_dir="/ckpt")        # instead of init_process_group
    model, optim = Net(), torch.optim.SGD(...)
    sampler = ElasticSampler(len(data), seed=0)       # instead of DistributedSampler
    ddp = run.wrap(model, optim, sampler)             # instead of DDP(model)
    for epoch in run.epochs(3):
        for x, y in run.batches(data.fetch, batch_size=32):
            with run.step():                          # one optimizer step
                optim.zero_grad()
                loss_fn(ddp(x), y).backward()
                optim.step()
    run.finish()

What the lines buy:

* **Checkpoints**: model, optimizer, sampler, :attr:`Run.global_step` and :attr:`Run.meta`
  every ``checkpoint_interval`` steps, on SIGTERM at the step boundary, and at the end;
  restored on start.
* **Exactly-once data**: :meth:`Run.batches` takes each step's indices from the
  :class:`~elasticjob_runtime.sampler.ElasticSampler`, the same number of steps on
  every rank (a rank may get an empty batch at an epoch's uneven end: ``fetch([])``
  must return an empty batch), and re-shards it whenever the world changes.
* **In-place recovery** under ``elasticjob-run``: when a peer leaves or joins, this
  process does not exit. A collective that fails (or that the agent abandons because
  its round lost a peer) drops the step in flight; the worker takes the next round's
  rank and world from its agent (:mod:`elasticjob_runtime.channel`), builds a fresh
  process group (:mod:`elasticjob_runtime.round_group`), and carries on from its own
  memory. A joiner, or a survivor one step behind, gets the state over the new group
  from the lowest rank holding the newest step; no checkpoint is read. When a new
  member joins a healthy group, every worker switches at its next step boundary.
* Without ``elasticjob-run`` (plain torchrun, or no launcher) the same script runs and
  recovers by restarting, from its checkpoints.

Code after the ``with run.step():`` block runs for a dropped step too; keep per-step
work (logging a loss) inside it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from elasticjob_runtime import contract
from elasticjob_runtime.channel import POLL_S, Assignment, WorkerChannel
from elasticjob_runtime.checkpoint import (
    CheckpointError,
    CheckpointManager,
    broadcast_bytes,
    deserialize,
    gather_steps,
    serialize,
    state_to_save,
)
from elasticjob_runtime.fingerprint import (
    DivergenceError,
    as_signed,
    disagreements,
    divergence_message,
    fingerprint,
)
from elasticjob_runtime.grad_weights import weighted_allreduce
from elasticjob_runtime.job_identity import current_job, directory_name
from elasticjob_runtime.loader import ElasticLoader
from elasticjob_runtime.progress import divergence_reporter_from_env, reporter_from_env
from elasticjob_runtime.records import DIVERGENCE_ACTIONS, Divergence
from elasticjob_runtime.round_group import RoundGroup, round_group
from elasticjob_runtime.sampler import ElasticSampler
from elasticjob_runtime.seeds import fetch_seed, seed_all, step_seed

log = logging.getLogger(__name__)

Batch = TypeVar("Batch")

# The variables torch's agent sets per round; a regrouped worker's environment follows.
ASSIGNED = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
# How often the watcher thread looks for an abandoned round: 100 looks a second cost
# about 2 % of a training step in CPU (measured, bench/README.md); 50 ms more to abandon a
# frozen peer's collectives is nothing beside the lease that detects it (1 s).
WATCH_POLL_S = 0.05
# How long a worker whose group broke waits for its agent's next round.
REGROUP_TIMEOUT_S = float(os.environ.get("ELASTICJOB_REGROUP_TIMEOUT", "900"))
# What gloo says when a peer's connection is gone (torch wraps it in a RuntimeError).
GLOO_FAILURES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "[gloo")
# The Run's own entries in the state; what users register goes beside them.
RESERVED_STATE = ("model", "optim", "sampler", "run")


def collective_failed(exc: BaseException) -> bool:
    """Is ``exc`` a collective that failed because the group broke (not a bug here)?"""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in GLOO_FAILURES)


def steps_left(remaining: int, world_size: int, batch_size: int) -> int:
    """Optimizer steps until the epoch's end: the same on every rank."""
    return -(-remaining // (world_size * batch_size))


class StepBrokeAfterUpdate(RuntimeError):
    """The group broke after this step's optimizer update: the worker cannot recover in
    place (its agent restarts it)."""


def registered_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The user's state objects, checked: each a torch Stateful, under a name of its own."""
    out: dict[str, Any] = {}
    for name, obj in state.items():
        if not isinstance(name, str) or not name or name in RESERVED_STATE:
            raise ValueError(
                f"state name {name!r} is not allowed: use a non-empty string other than "
                f"{', '.join(RESERVED_STATE)} (the Run's own entries)"
            )
        methods = (getattr(obj, "state_dict", None), getattr(obj, "load_state_dict", None))
        if not all(callable(method) for method in methods):
            raise TypeError(
                f"state[{name!r}] is a {type(obj).__name__}, which has no state_dict() and "
                "load_state_dict(); wrap it in a class that has both (torch's Stateful "
                "protocol), or keep plain values in run.meta"
            )
        out[name] = obj
    return out


def sampler_position(sampler: ElasticSampler) -> dict[str, Any]:
    """The sampler's state as compared: a finished epoch is the next one's start (a rank
    that already moved on and one that has not hold the same position)."""
    state = dict(sampler.state_dict())
    if state["consumed"] >= state["num_samples"]:
        state.update(epoch=int(state["epoch"]) + 1, consumed=0)
    return state


def gather_rows(mine: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's row of int64 values, in rank order."""
    tensor = torch.tensor(mine, dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return [[int(v) for v in row.tolist()] for row in gathered]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _solo_env() -> None:
    """A world of one when no launcher set one up (``python train.py``)."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )


def default_checkpoint_dir() -> Path:
    """Per job (job_identity.py), not per run id: torchrun's default run id is ``none``
    for every job, and two jobs on one machine must not resume each other."""
    launched = "TORCHELASTIC_RUN_ID" in os.environ
    job = directory_name(current_job()) if launched else "local"
    return Path(tempfile.gettempdir()) / "elasticjob-checkpoints" / job


@dataclass
class StepOutcome:
    """What ``with run.step() as outcome:`` tells the code after the block."""

    committed: bool = False  # False: the step was dropped (the group broke in it)


class CurrentDDP:
    """The model as the current round's ``DistributedDataParallel`` wraps it: call it and
    read its attributes as the DDP module; it is re-wrapped after every regroup."""

    def __init__(self, run: Run) -> None:
        self._run = run

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run.ddp(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._run.ddp, name)


class Run:
    """One worker's part in an elastic training run (see the module docstring)."""

    def __init__(
        self,
        *,
        checkpoint_dir: str | Path | None = None,
        checkpoint_interval: int = 100,
        keep: int = 3,
        backend: str = "gloo",
        timeout: float | None = None,
        sigterm_grace: float = 5.0,
        in_place: bool | None = None,
        on_regroup: Callable[[Run], None] | None = None,
        seed: int | None = 0,
        check_every: int = 100,
        on_divergence: str = "stop",
        async_checkpoint: bool = True,
    ) -> None:
        """``in_place`` (default: on unless ``ELASTICJOB_IN_PLACE=0``) regroups a healthy
        worker across membership changes under ``elasticjob-run``; off, it exits and
        its agent restarts it, as under any other launcher. ``on_regroup(run)`` is
        called after each regroup in place, before the next step (to log it).

        ``seed``: each step seeds torch, CUDA, ``random`` and numpy from ``(seed, step,
        rank)`` (:mod:`elasticjob_runtime.seeds`), so a retried or restarted step draws
        the same numbers; None leaves the generators alone. ``check_every``: the ranks
        compare fingerprints of all training state every that many steps (0: only after
        regroups and restores, and at the first step after one); ``on_divergence``:
        ``"stop"`` raises :class:`DivergenceError` naming what differs, ``"resync"``
        copies rank 0's state to every rank and says so.

        ``async_checkpoint``: a save copies the state to CPU on the training thread and
        serialises, hashes and writes it in a thread (one save in flight); the price is
        one CPU copy of the state kept between saves. False writes on the training
        thread (a 53 MB state: 0.27 s a save here, an fsync the most of it)."""
        if checkpoint_interval < 1:
            raise ValueError(f"checkpoint_interval must be at least 1 (got {checkpoint_interval})")
        if check_every < 0:
            raise ValueError(f"check_every must be 0 (off) or more (got {check_every})")
        if on_divergence not in DIVERGENCE_ACTIONS:
            raise ValueError(
                f"on_divergence must be one of {', '.join(DIVERGENCE_ACTIONS)} "
                f"(got {on_divergence!r})"
            )
        _solo_env()
        launched = "TORCHELASTIC_RUN_ID" in os.environ
        if in_place is None:
            in_place = os.environ.get(contract.IN_PLACE, "1") != "0"
        self._channel = WorkerChannel.from_env() if in_place else None
        current = self._channel.latest() if self._channel is not None else None
        self._generation = current.generation if current is not None else 0
        self._assignment = self._assignment_from_env()
        self._timeout = timedelta(seconds=timeout) if timeout else timedelta(minutes=30)
        self._group: RoundGroup = round_group(backend)
        started = time.monotonic()
        self._group.build(self._assignment, self._timeout)
        # Seconds of the last (re)grouping: wait (for the round), process_group, restore, ddp.
        self.timings: dict[str, float] = {"wait": 0.0, "process_group": time.monotonic() - started}

        self.checkpoint_interval = checkpoint_interval
        # The node-memory copy is keyed by run id: without a launcher there is none, and
        # a later plain run would silently resume an earlier one, so keep it off there.
        self.ckpt = CheckpointManager(
            checkpoint_dir or default_checkpoint_dir(),
            keep=keep,
            memory=launched,
            async_save=async_checkpoint,
        )
        self.ckpt.install_sigterm_handler(grace_s=sigterm_grace)
        self.ckpt.track(self._state)
        self.reporter = reporter_from_env()

        self.global_step = 0  # optimizer steps completed by the whole group
        self.samples = 0  # samples those steps consumed, all ranks together
        self.meta: dict[str, Any] = {}  # saved and restored with the state (JSON-like values)
        self.restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.regroups = 0  # rounds this process joined in place
        # "fresh", "checkpoint step N", "rank R at step N" or "own memory at step N"
        self.resumed_from = "fresh"
        self.global_batch = 0  # samples the whole group takes in the current step

        self.seed = seed
        self.check_every = check_every
        self.on_divergence = on_divergence
        self.resyncs = 0  # times rank 0's state was copied over a divergence
        # compare at the next commit, the first after a regroup or restore: why, or None
        self._check_next: str | None = None

        self._module: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._sampler: ElasticSampler | None = None
        self._registered: dict[str, Any] = {}  # the user's Stateful objects, by name
        self._weighted = False  # a run.loader() exists: DDP weighs ranks by their samples
        self._rank_samples: int | None = None  # this rank's real samples in this step
        self._updated = False  # an optimizer stepped in the step under way
        self._plan = 0  # bumped when the state changed under a round's plan (a resync)
        self._ddp: DistributedDataParallel | None = None
        self._ddp_kwargs: dict[str, Any] = {}
        self._live = False  # holds state newer than any checkpoint, after the first sync
        self._batch_size = 1
        self._max_steps: int | None = None
        self._phase = "idle"  # idle -> fetched (a batch is out) -> running (in step())
        self._aborted_generation = -1
        self._closed = threading.Event()
        self._parent = os.getppid()  # the agent; a worker whose agent died stops waiting
        self._on_regroup = on_regroup
        self._watcher: threading.Thread | None = None

    # -- who we are this round

    @staticmethod
    def _assignment_from_env() -> Assignment:
        env = {name: os.environ[name] for name in ASSIGNED if name in os.environ}
        return Assignment(0, env)

    @property
    def rank(self) -> int:
        return self._assignment.rank

    @property
    def world_size(self) -> int:
        return self._assignment.world_size

    @property
    def local_rank(self) -> int:
        return int(self._assignment.env.get("LOCAL_RANK", "0"))

    @property
    def ddp(self) -> DistributedDataParallel:
        if self._ddp is None:
            raise RuntimeError("call run.wrap(model, optimizer, sampler) first")
        return self._ddp

    @property
    def sampler(self) -> ElasticSampler:
        if self._sampler is None:
            raise RuntimeError("call run.wrap(model, optimizer, sampler) first")
        return self._sampler

    # -- set-up

    def wrap(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: ElasticSampler,
        *,
        state: Mapping[str, Any] | None = None,
        **ddp_kwargs: Any,
    ) -> CurrentDDP:
        """Restore (from a peer's memory or a checkpoint), wrap ``model`` in DDP, and
        register the three for checkpoints and in-place recovery.

        ``state`` names every other object that changes during training and has
        ``state_dict()``/``load_state_dict()`` (torch's Stateful: LR schedulers,
        GradScalers, EMA models, extra optimizers, your own classes): each is saved,
        restored, sent to joining and lagging workers and fingerprinted with the model.
        """
        self._registered = registered_state(state or {})
        self._module, self._optimizer, self._sampler = model, optimizer, sampler
        for optim in (optimizer, *self._registered.values()):
            if isinstance(optim, torch.optim.Optimizer):
                optim.register_step_post_hook(self._note_update)
        self._ddp_kwargs = ddp_kwargs
        sampler.reshard(self.rank, self.world_size)
        self._restore_and_wrap()
        if self._channel is not None:
            self._channel.offer_in_place()
            self._watcher = threading.Thread(
                target=self._watch, name="elasticjob-round-watch", daemon=True
            )
            self._watcher.start()
        return CurrentDDP(self)

    def _state(self) -> Mapping[str, Any]:
        return {
            "model": self._module,
            "optim": self._optimizer,
            "sampler": self._sampler,
            "run": {"step": self.global_step, "samples": self.samples, "meta": dict(self.meta)},
            **self._registered,
        }

    def _load(self, state: Mapping[str, Any]) -> None:
        missing = [key for key in self._state() if key not in state]
        if missing:
            raise CheckpointError(
                f"the state to resume from has no {missing} (it has {sorted(state)}): "
                "every rank must pass the same objects to run.wrap(..., state=...), and a "
                "checkpoint saved before an object was added cannot restore it; start "
                "from a new checkpoint directory, or drop the object from state="
            )
        for key, target in self._state().items():
            loader = getattr(target, "load_state_dict", None)
            if callable(loader):
                loader(state[key])
        self.global_step = int(state["run"]["step"])
        self.samples = int(state["run"].get("samples", 0))
        self.meta.clear()
        self.meta.update(state["run"]["meta"])

    def _share_state(self) -> None:
        """Every rank ends at the newest step any rank holds in memory; when none holds
        one (a first start, or every process restarted), at the newest checkpoint."""
        device = self._group.device
        steps = gather_steps(self.global_step if self._live else -1, device)
        newest = max(steps)
        if newest < 0:
            resumed = self.ckpt.restore(self._state())  # agrees over the group itself
            if resumed is not None:
                self._load(resumed.state)
                self.resumed_from = f"checkpoint step {resumed.step}"
            elif self.world_size > 1:
                # A fresh start: rank 0's state is the run's (DDP copies only the module's
                # parameters; an EMA or a scheduler built from an unseeded model would differ).
                self._copy_from(0)
        elif all(step == newest for step in steps):
            self.resumed_from = f"own memory at step {newest}"
        else:
            src = steps.index(newest)
            data = serialize(state_to_save(self._state())) if self.rank == src else b""
            received = broadcast_bytes(data, src, device)
            if steps[self.rank] == newest:
                self.resumed_from = f"own memory at step {newest}"
            else:
                self._load(deserialize(received))
                self.resumed_from = f"rank {src} at step {newest}"
        self._live = True

    def _copy_from(self, src: int) -> None:
        """Every rank takes rank ``src``'s whole state."""
        data = serialize(state_to_save(self._state())) if self.rank == src else b""
        received = broadcast_bytes(data, src, self._group.device)
        if self.rank != src:
            self._load(deserialize(received, source=f"rank {src}"))

    def _restore_and_wrap(self) -> None:
        started = time.monotonic()
        self._share_state()
        wrapped = time.monotonic()
        # The state was just shared (or restored from one checkpoint) whole, and is
        # compared below: DDP's own broadcast of every parameter would be a second copy.
        ddp_kwargs = {"init_sync": False, **self._ddp_kwargs}
        self._ddp = DistributedDataParallel(self._module, **ddp_kwargs)
        if self._weighted:
            self._ddp.register_comm_hook(self, weighted_allreduce)
        self.timings["restore"] = wrapped - started
        self.timings["ddp"] = time.monotonic() - wrapped
        checked = time.monotonic()
        self._check_agreement("after the group formed")
        # State that never went through the Run shows at the first step: check it there.
        self._check_next = "the first step after the group formed"
        self.timings["check"] = time.monotonic() - checked

    # -- agreement (fingerprint.py)

    def _checked_state(self) -> dict[str, Any]:
        """What every rank must hold identically, by the name a mismatch reports.
        Not ``run.meta``: a script may keep rank 0's own values there (the best accuracy
        its validation saw); it is saved from one rank and handed to joiners as is."""
        return {
            "model": self._module,
            "optim": self._optimizer,
            "sampler": sampler_position(self.sampler),
            "run": {"step": self.global_step, "samples": self.samples},
            **self._registered,
        }

    def _check_agreement(self, when: str) -> None:
        """Compare every rank's fingerprints; stop (or resync) when they differ."""
        if self.world_size < 2:
            return
        checked = self._checked_state()
        mine = [as_signed(fingerprint(obj)) for obj in checked.values()]
        rows = gather_rows(mine, self._group.device)
        found = disagreements(list(checked), rows)
        if not found:
            return
        message = divergence_message(self.global_step, when, found)
        self._report_divergence(message)
        if self.on_divergence == "resync":
            log.error("%s; copying rank 0's state to every rank (on_divergence='resync')", message)
            self._copy_from(0)
            self.resyncs += 1
            self._plan += 1  # the sampler's position may have moved: plan the round anew
            return
        if self._channel is not None:
            self._channel.say_fatal(message)  # the agent must not restart into the same bug
        raise DivergenceError(message)

    def _report_divergence(self, message: str) -> None:
        """Tell the operator (the run's etcd): it fails the job, or says that the ranks
        were resynced. Every rank writes the step's one key before it stops: a pod that
        fails before the record exists would be replaced as an ordinary failure."""
        report = divergence_reporter_from_env()
        if report is not None:
            pod = os.environ.get(contract.POD_NAME) or socket.gethostname()
            report(Divergence(self.global_step, self.on_divergence, message, pod, time.time()))

    def _check_due(self) -> None:
        when = self._check_next
        if when is None and self.check_every and self.global_step % self.check_every == 0:
            when = f"checked every {self.check_every} steps"
        if when is not None:
            self._check_next = None
            self._check_agreement(when)

    # -- the loop

    @property
    def reached_max_steps(self) -> bool:
        return self._max_steps is not None and self.global_step >= self._max_steps

    def epochs(self, count: int, max_steps: int | None = None) -> Iterator[int]:
        """Epochs from the restored one up to ``count`` (or until ``max_steps``)."""
        self._max_steps = max_steps
        sampler = self.sampler
        while sampler.epoch < count and not self.reached_max_steps:
            epoch = sampler.epoch
            yield epoch
            if sampler.epoch == epoch and sampler.remaining == 0:
                sampler.set_epoch(epoch + 1)

    def batches(self, fetch: Callable[[list[int]], Batch], batch_size: int) -> Iterator[Batch]:
        """This rank's batch for each step left in the epoch: ``fetch(indices)``.

        :meth:`loader` does the same with a torch ``DataLoader`` (worker processes,
        prefetch, no empty batches); this is the plain form, in the training thread."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1 (got {batch_size})")

        def fetch_round(shard: list[int], steps: int) -> Iterator[Batch]:
            for j in range(steps):
                indices = shard[j * batch_size : (j + 1) * batch_size]
                self._rank_samples = len(indices)
                if self.seed is not None:  # fetch runs before its step: seeded on its own
                    seed_all(fetch_seed(self.seed, self.global_step + 1, self.rank))
                yield fetch(indices)

        return self._steps(batch_size, fetch_round)

    def loader(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        *,
        accumulate: int = 1,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        persistent_workers: bool | None = None,
        prefetch_factor: int | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
    ) -> ElasticLoader:
        """A torch ``DataLoader`` over ``dataset`` that yields this rank's batch for each
        step (``accumulate`` micro-batches of ``batch_size`` when above 1: train them in
        one ``with run.step():`` through :meth:`accumulate`). Worker processes are
        persistent by default and survive regroups; loader.py says how. Call after
        :meth:`wrap`; ``dataset`` is the one the sampler was made for."""
        made = ElasticLoader(
            self,
            dataset,
            batch_size,
            accumulate=accumulate,
            seed=self.sampler.seed if self.seed is None else self.seed,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
        )
        if not self._weighted:
            self._weighted = True
            if self._ddp is not None:
                self._ddp.register_comm_hook(self, weighted_allreduce)
        return made

    def accumulate(self, micro_batches: Sequence[Batch]) -> Iterator[Batch]:
        """The step's micro-batches, each trained under DDP's ``no_sync`` but the last, so
        gradients are all-reduced once per step: ``for x, y in run.accumulate(batch):``."""
        last = len(micro_batches) - 1
        for i, micro in enumerate(micro_batches):
            if i < last:
                with self.ddp.no_sync():
                    yield micro
            else:
                yield micro

    def _set_rank_samples(self, samples: int) -> None:
        self._rank_samples = samples

    @property
    def weighted_samples(self) -> int | None:
        """This rank's samples in the step, for the loader's gradient weights."""
        return self._rank_samples

    @property
    def rank_samples(self) -> int:
        """Samples this rank trains on in the current step: 0 for the filler batch a rank
        gets when the epoch's last step has fewer samples than ranks (loader.py)."""
        return self._rank_samples if self._rank_samples is not None else self._batch_size

    def _steps(
        self, step_size: int, start_round: Callable[[list[int], int], Iterator[Batch]]
    ) -> Iterator[Batch]:
        """Each step's batch until the epoch ends, round after round: ``start_round(shard,
        steps)`` yields the round's batches from this rank's ``shard`` (its indices from
        the committed position on); a regroup starts a new round from where the group is."""
        self._batch_size = step_size
        sampler = self.sampler
        epoch = sampler.epoch

        def more() -> bool:
            return sampler.epoch == epoch and sampler.remaining > 0 and not self.reached_max_steps

        while more():
            if self._switch_pending():
                self._regroup(failed=False)
            generation, plan = self._generation, self._plan
            steps = steps_left(sampler.remaining, self.world_size, step_size)
            started = time.monotonic()
            produced = start_round(list(sampler), steps)  # this round's shard
            first = True
            while generation == self._generation and plan == self._plan and more():
                if self._switch_pending():
                    break  # a new member: switch here, between steps
                self.global_batch = min(self.world_size * step_size, sampler.remaining)
                batch = next(produced)
                if first:  # a round's plan, and the loader's refill after a reset
                    self.timings["first_batch"] = time.monotonic() - started
                    first = False
                self._phase = "fetched"
                yield batch
                if self._phase == "fetched":
                    raise RuntimeError(
                        "each batch from run.batches() or run.loader() needs one "
                        "`with run.step():` around its training step"
                    )

    @contextlib.contextmanager
    def step(self) -> Iterator[StepOutcome]:
        """One optimizer step: committed when the block ends; dropped (and the group
        rebuilt) when a collective in it fails because the group broke. A dropped step
        leaves no gradient behind, wherever the script calls ``zero_grad``."""
        if self._phase != "fetched":
            raise RuntimeError(
                "`with run.step():` goes once around each batch of run.batches() or run.loader()"
            )
        self._phase = "running"
        self._updated = False
        if self.seed is not None:
            seed_all(step_seed(self.seed, self.global_step + 1, self.rank))
        outcome = StepOutcome()
        try:
            yield outcome
        except Exception as exc:
            self._phase = "idle"
            if not self._group_broke(exc):
                raise
            if self._updated:
                # A collective after optimizer.step() failed: the update ran, the rest of
                # the step (the scaler's update, the scheduler, the EMA) did not. Dropping
                # the step would apply the update twice, keeping it would leave it half
                # done: neither is the unfaulted run. This process restarts instead, and
                # takes the state from a peer that never got so far, or a checkpoint.
                raise StepBrokeAfterUpdate(
                    f"step {self.global_step + 1} broke after the optimizer's update (a "
                    "collective after optimizer.step() failed: "
                    f"{str(exc).splitlines()[0]}); this worker restarts and resumes from "
                    "a peer or the last checkpoint. Move collectives of your own before "
                    "optimizer.step() to recover in place"
                ) from exc
            log.warning("step %d dropped: %s", self.global_step + 1, str(exc).splitlines()[0])
            self._clear_gradients()
            self._regroup(failed=True)
            return
        self._phase = "idle"
        self._commit()
        outcome.committed = True
        try:
            self._check_due()
        except Exception as exc:
            if not self._group_broke(exc):
                raise
            log.warning("agreement check after step %d broke: %s", self.global_step, exc)
            self._regroup(failed=True)  # the step stands: peers without it get it

    def _group_broke(self, exc: BaseException) -> bool:
        """Did ``exc`` come from the group breaking (regroup), not from the script?"""
        return self._channel is not None and (
            collective_failed(exc) or self._aborted_generation == self._generation
        )

    def _note_update(self, *_: Any) -> None:
        """An optimizer's step-post hook: this step's update has run."""
        self._updated = True

    def _clear_gradients(self) -> None:
        """A dropped step's gradients are partial (some buckets reduced, some not) and
        would be added into the retried step by a script that zeroes after stepping."""
        if self._module is not None:
            self._module.zero_grad(set_to_none=True)
        optimizers = [self._optimizer, *self._registered.values()]
        for optimizer in optimizers:
            if isinstance(optimizer, torch.optim.Optimizer):
                optimizer.zero_grad(set_to_none=True)

    def _commit(self) -> None:
        self.global_step += 1
        self.samples += self.global_batch
        self.sampler.advance(self.world_size * self._batch_size)
        self.ckpt.mark_step(self.global_step)  # after SIGTERM: saves this step and exits 143
        if self.global_step % self.checkpoint_interval == 0:
            self.save()
        if self.reporter is not None:
            self.reporter.update(
                self.global_step,
                self.global_batch,
                epoch=self.sampler.epoch,
                checkpoint_step=self.ckpt.saved_step,
                world_size=self.world_size,
                checkpoint_error=self.ckpt.save_error,
            )

    def save(self) -> None:
        """Checkpoint the current step now (e.g. at an epoch's end), besides the interval.

        A save that failed on a full or read-only directory is tried again at the next
        call (its error is in ``ckpt.save_error`` and the job's progress)."""
        if self.global_step not in (self.ckpt.saved_step, self.ckpt.pending_step):
            self.ckpt.save(self._state(), self.global_step)

    # -- regrouping

    def _switch_pending(self) -> bool:
        if self._channel is None:
            return False
        latest = self._channel.latest()
        return latest is not None and latest.generation > self._generation

    def _watch(self) -> None:
        """Abandon the round's collectives as soon as the agent says it lost a peer, or
        the agent is gone (nobody will hand this worker another round)."""
        assert self._channel is not None
        channel = WorkerChannel(self._channel.directory, self._channel.local_rank)
        while not self._closed.wait(WATCH_POLL_S):
            latest = channel.latest()
            generation = self._generation
            orphaned = os.getppid() != self._parent
            newer = latest is not None and latest.generation > generation
            if not orphaned and not (newer and latest is not None and latest.abort):
                continue
            if self._aborted_generation < generation:
                self._aborted_generation = generation
                self._group.abort()

    def _regroup(self, failed: bool) -> None:
        """Leave this round's group and join the next one, keeping everything in memory."""
        assert self._channel is not None
        started = time.monotonic()
        # The old DDP (and through it the old group) is dropped only once the next round
        # stands: freeing it joins gloo's threads, and one of them may still be finishing
        # the aborted work, which needs the GIL this thread would hold while it waits.
        retired = [self._ddp]
        self._ddp = None
        while True:
            self.ckpt.mark_step(self.global_step)  # SIGTERM now: save this step, exit 143
            if failed:
                self._channel.request_regroup(self._generation)
            self._aborted_generation = self._generation
            self._group.abort()  # peers blocked on us fail now instead of at a timeout
            self._group.destroy()
            assignment = self._next_assignment(started)
            self._generation, self._assignment = assignment.generation, assignment
            os.environ.update(assignment.env)
            waited = time.monotonic() - started
            try:
                built = time.monotonic()
                self._group.build(assignment, self._timeout)
                self.timings = {"wait": waited, "process_group": time.monotonic() - built}
                self.sampler.reshard(self.rank, self.world_size)
                self._restore_and_wrap()
            except Exception as exc:
                if not collective_failed(exc):
                    raise
                log.warning("round %d broke while forming: %s", assignment.generation, exc)
                failed = True
                continue
            break
        retired.clear()
        self.regroups += 1
        log.warning(
            "regrouped in place: rank %d of %d at step %d in %.2f s",
            self.rank,
            self.world_size,
            self.global_step,
            time.monotonic() - started,
        )
        self._follow_rank_0()
        if self._on_regroup is not None:
            self._on_regroup(self)

    def _follow_rank_0(self) -> None:
        """Global rank 0 publishes progress; after a regroup it may be this process."""
        if self.rank == 0 and self.reporter is None:
            self.reporter = reporter_from_env()
        elif self.rank != 0 and self.reporter is not None:
            self.reporter.close(wait=0)  # the new rank 0 publishes; training goes on now
            self.reporter = None

    def _next_assignment(self, started: float) -> Assignment:
        assert self._channel is not None
        while True:
            found = self._channel.wait_newer(self._generation, timeout=0.25)
            if found is not None:
                self._channel.say_taken(found.generation)
                return found
            self.ckpt.mark_step(self.global_step)
            if os.getppid() != self._parent:
                raise RuntimeError("the elasticjob-run agent exited while its workers regrouped")
            if time.monotonic() - started > REGROUP_TIMEOUT_S:
                raise RuntimeError(
                    f"no new round from the agent within {REGROUP_TIMEOUT_S:.0f} s after the "
                    "process group broke (ELASTICJOB_REGROUP_TIMEOUT sets the limit)"
                )

    # -- the end

    def finish(self) -> None:
        """Save the last step, withdraw the progress record, and leave the group."""
        if self.ckpt.stop_requested:
            self.ckpt.mark_step(self.global_step)  # SIGTERM during the last step: save, exit 143
        if self._live:
            self.ckpt.wait()  # an interval save of this step that failed is made again
            self.save()
        if self._channel is not None:
            self._settle_rounds()
        self.ckpt.close()
        if self.reporter is not None:
            self.reporter.close()
        self._closed.set()
        if self._watcher is not None:
            self._watcher.join()
        self._group.destroy()

    def _settle_rounds(self) -> None:
        """Before this process exits, build any round its agent formed or is forming for
        it: its other members (a node that joined as training ended) wait in that round
        for this worker, and get the final state from it (channel.py says why)."""
        assert self._channel is not None
        self._channel.say_finished()
        started = time.monotonic()
        while True:
            if self._switch_pending():
                self._regroup(failed=False)
                continue
            if not self._channel.agent_regrouping():
                return
            if os.getppid() != self._parent or time.monotonic() - started > REGROUP_TIMEOUT_S:
                return  # nobody will deliver that round: leave
            time.sleep(POLL_S)

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if kind is None:
            self.finish()
