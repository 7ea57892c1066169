"""The training-loop API: a DDP script made elastic in about ten lines, recovering in place.

A plain DDP loop, and the same loop with this API (docs/training-loop.md has the diff)::

    run = Run(checkpoint_dir="/ckpt")                # instead of init_process_group
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
  :class:`~elasticjob_runtime.training.sampler.ElasticSampler`, the same number of steps on
  every rank (a rank may get an empty batch at an epoch's uneven end: ``fetch([])``
  must return an empty batch), and re-shards it whenever the world changes.
* **In-place recovery** under ``elasticjob-run``: when a peer leaves or joins, this
  process does not exit. A collective that fails (or that the agent abandons because
  its round lost a peer) drops the step in flight; the worker takes the next round's
  rank and world from its agent (:mod:`elasticjob_runtime.launch.channel`), builds a fresh
  process group (:mod:`elasticjob_runtime.training.round_group`), and carries on from its own
  memory. A joiner, or a survivor one step behind, gets the state over the new group
  from the lowest rank holding the newest step; no checkpoint is read. When a new
  member joins a healthy group, or a node leaves it announced, the ranks agree within a
  step that the round ends (:mod:`elasticjob_runtime.training.switch_vote`) and every
  worker switches at that same step boundary.
* **Sharded models**: ``run.shard(build, sampler)`` instead of ``run.wrap`` for a model
  that FSDP2 shards: ``build(mesh)`` shards it on each round's mesh, the shards move
  between the ranks' memory when the world changes, and checkpoints are DCP
  (:mod:`elasticjob_runtime.training.fsdp_replication`).
* Without ``elasticjob-run`` (plain torchrun, or no launcher) the same script runs and
  recovers by restarting, from its checkpoints.

Code after the ``with run.step():`` block runs for a dropped step too; keep per-step
work (logging a loss) inside it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from elasticjob_runtime import contract
from elasticjob_runtime.checkpoints.job_identity import current_job, directory_name
from elasticjob_runtime.checkpoints.manager import CheckpointManager
from elasticjob_runtime.checkpoints.sharded import ShardedCheckpoints
from elasticjob_runtime.etcd.progress import reporter_for_rank, reporter_from_env
from elasticjob_runtime.goodput.keeper import fresh_keeper, read_published, regroup_cause
from elasticjob_runtime.goodput.ledger import Ledger
from elasticjob_runtime.launch.torch_internals import default_group_on_demand
from elasticjob_runtime.training.agreement import Agreement
from elasticjob_runtime.training.current import Current, Sharded
from elasticjob_runtime.training.current_ddp import CurrentDDP
from elasticjob_runtime.training.ddp_replication import DDPReplication
from elasticjob_runtime.training.device_choice import DEVICE_ENV, choose_device, visible_gpus
from elasticjob_runtime.training.formation import gather_formation
from elasticjob_runtime.training.fsdp_replication import Build, FSDPReplication
from elasticjob_runtime.training.ledger_sync import Held, offer, sync_ledger
from elasticjob_runtime.training.loader import ElasticLoader
from elasticjob_runtime.training.loader_options import refused_option
from elasticjob_runtime.training.replication import Replication
from elasticjob_runtime.training.sampler import ElasticSampler
from elasticjob_runtime.training.state import TrainingState, registered_state
from elasticjob_runtime.training.step_loop import StepLoop, StepOutcome
from elasticjob_runtime.training.worker_rounds import WorkerRounds

log = logging.getLogger(__name__)

# run.shard's default: a copy of each rank's shards in a peer's memory every 10 steps
DEFAULT_COPY_EVERY = 10
EARLY_GROUP = (
    "torch.distributed was called between Run() and run.wrap()/run.shard(): the Run builds "
    "its process group at wrap/shard now (a joining or replacing worker then builds its "
    "model before its peers wait for it), and built it early for this call. Read "
    "run.rank and run.world_size before wrap, and call collectives after it; from the "
    "next release such a call raises, as torch's does without a group."
)

Batch = TypeVar("Batch")


def registered_now(state: TrainingState, name: str) -> Any:
    """The current round's registered object ``name`` (a sharded model's are rebuilt)."""
    return state.registered[name]


def default_checkpoint_dir() -> Path:
    """Per job (job_identity.py), not per run id: torchrun's default run id is ``none``
    for every job, and two jobs on one machine must not resume each other."""
    launched = "TORCHELASTIC_RUN_ID" in os.environ
    job = directory_name(current_job()) if launched else "local"
    return Path(tempfile.gettempdir()) / "elasticjob-checkpoints" / job


def checkpoint_dir_of(asked: str | Path | None, env: Mapping[str, str]) -> Path | None:
    """Where the Run checkpoints: ``checkpoint_dir=``, else ``ELASTICJOB_CHECKPOINT_DIR``
    (every example manifest sets it to a mounted volume), else None: the temp dir. Read
    from the environment because a script written without it must not checkpoint into
    the pod's /tmp under a manifest that mounted a volume for it."""
    chosen = asked or env.get(contract.CHECKPOINT_DIR)
    return Path(chosen) if chosen else None


def run_checkpoints(
    directory: str | Path | None, keep: int, async_save: bool, sigterm_grace: float
) -> CheckpointManager:
    """The Run's checkpoints, saving the last step on SIGTERM. The node-memory copy is
    keyed by run id: without a launcher there is none, and a later plain run would
    silently resume an earlier one, so it is off there."""
    chosen = checkpoint_dir_of(directory, os.environ)
    if chosen is None and "TORCHELASTIC_RUN_ID" in os.environ:
        log.warning(
            "checkpoints go to %s, which a lost pod takes with it: pass checkpoint_dir= "
            "or set %s to a volume that outlives the pod",
            default_checkpoint_dir(),
            contract.CHECKPOINT_DIR,
        )
    ckpt = CheckpointManager(
        chosen or default_checkpoint_dir(),
        keep=keep,
        memory="TORCHELASTIC_RUN_ID" in os.environ,
        async_save=async_save,
    )
    ckpt.install_sigterm_handler(grace_s=sigterm_grace)
    return ckpt


class Run:
    """One worker's part in an elastic training run: made once per worker process in
    place of ``init_process_group``, it joins the current round, restores the state,
    drives the steps (``epochs``, ``loader``, ``step``) and regroups in place when the
    membership changes (docs/training-loop.md).

    Its process group is built at ``wrap`` (or ``shard``), not here: a worker that joins
    a running group, or replaces a dead member, builds its model first, while its peers
    still train. Between ``Run()`` and ``wrap``, read ``run.rank`` and
    ``run.world_size``; a ``torch.distributed`` call there builds the group early, with a
    ``FutureWarning`` (it will raise from the next release)."""

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
        device: str | torch.device | None = None,
    ) -> None:
        """``in_place`` (default: on unless ``ELASTICJOB_IN_PLACE=0``) regroups a healthy
        worker across membership changes under ``elasticjob-run``; off, it exits and
        its agent restarts it, as under any other launcher. ``on_regroup(run)`` is
        called after each regroup in place, before the next step (to log it).

        ``seed``: each step seeds torch, CUDA, ``random`` and numpy from ``(seed, step,
        rank)`` (:mod:`elasticjob_runtime.training.seeds`), so a retried or restarted step draws
        the same numbers; None leaves the generators alone. ``check_every``: the ranks
        compare fingerprints of all training state every that many steps, and at the first
        step after each regroup and restore (0: only there); ``on_divergence``:
        ``"stop"`` raises :class:`DivergenceError` naming what differs, ``"resync"``
        copies rank 0's state to every rank and says so.

        ``async_checkpoint``: a save copies the state to CPU on the training thread and
        serialises, hashes and writes it in a thread (one save in flight); the price is
        one CPU copy of the state kept between saves. False writes on the training
        thread (a 53 MB state: 0.27 s a save here, an fsync the most of it). A sharded
        model (``run.shard``) saves the same way, every rank its own shards, and rank 0
        commits the checkpoint once every rank's part is written
        (:mod:`elasticjob_runtime.checkpoints.sharded`).

        ``checkpoint_dir``: default ``ELASTICJOB_CHECKPOINT_DIR`` (the manifests' volume),
        else the temp dir, which a lost pod takes with it (logged under a launcher).

        ``device``: where this rank trains, ``run.device`` (default: ``ELASTICJOB_DEVICE``,
        else ``cuda:LOCAL_RANK`` where CUDA is there, else the CPU;
        :mod:`elasticjob_runtime.training.device_choice`). A CUDA device is made current
        here, before the process group is built; the script moves its model and batches
        there."""
        if checkpoint_interval < 1:
            raise ValueError(f"checkpoint_interval must be at least 1 (got {checkpoint_interval})")
        asked = str(device) if device is not None else os.environ.get(DEVICE_ENV)
        self._device = choose_device(int(os.environ.get("LOCAL_RANK", "0")), visible_gpus(), asked)
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # NCCL's group and CUDA's default use it
        self._agreement = Agreement(check_every, on_divergence)
        self._rounds = WorkerRounds(backend, timeout, in_place)
        # Seconds of the last (re)grouping: wait (for the round), process_group, restore,
        # ddp or build (the model laid out for the round), check.
        self.timings: dict[str, float] = {"wait": 0.0, "process_group": 0.0}
        self._state = TrainingState()
        self.checkpoint_interval = checkpoint_interval
        self.ckpt = run_checkpoints(checkpoint_dir, keep, async_checkpoint, sigterm_grace)
        self.ckpt.track(self._state.objects)
        self._rounds.on_leave = self.ckpt.wait  # a hand-over finishes a save in flight
        self.reporter = reporter_from_env()
        self.restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.regroups = 0  # rounds this process joined in place
        # "fresh", "checkpoint step N", "rank R at step N" or "own memory at step N"
        self.resumed_from = "fresh"
        self._loop = StepLoop(
            self._state,
            self._rounds,
            self._agreement,
            seed,
            self._regroup,
            self._committed,
            self.timings,
            resynced=lambda began: self._goodput.resynced(began),
        )
        self._replica: Replication | None = None  # how the model is laid out, once wrapped
        self._weigh_by_samples = False  # run.loader() was made: weigh gradients by samples
        self._on_regroup = on_regroup
        # where each second of the run went; every rank keeps it, rank 0 publishes it
        # (goodput/keeper.py); the group's copy once the first group forms (_form)
        self._goodput = fresh_keeper()
        self._goodput_held = Held.NEW  # what this rank's copy is to the next group
        # The group is built at wrap/shard (_build_group); until then a torch.distributed
        # call that needs it builds it, with a warning (EARLY_GROUP).
        self._end_on_demand = default_group_on_demand(self._group_asked_early)

    # -- who we are this round, and what we hold

    @property
    def device(self) -> torch.device:
        """Where this rank trains: ``cuda:LOCAL_RANK`` on a GPU node, else the CPU, unless
        ``device=`` or ``ELASTICJOB_DEVICE`` said otherwise (device_choice.py). Move the
        model and each batch here."""
        return self._device

    @property
    def rank(self) -> int:
        """This worker's rank in the current round (it may change at a regroup)."""
        return self._rounds.rank

    @property
    def world_size(self) -> int:
        """Ranks in the current round."""
        return self._rounds.world_size

    @property
    def local_rank(self) -> int:
        """This worker's index on its node (``LOCAL_RANK``): its GPU's, by default."""
        return self._rounds.local_rank

    @property
    def round_id(self) -> str:
        """Names the group this rank is in, the same on every rank of it and new each
        time a group forms (``<run id>/<rendezvous round>.<token>``): a line logged in a
        step with it says which attempt at the step it belongs to, since a dropped step
        is redone only in a later group. ``outcome.round_id`` keeps the step's own."""
        return self._rounds.round_id

    @property
    def global_step(self) -> int:
        """Optimizer steps completed by the whole group."""
        return self._state.step

    @property
    def samples(self) -> int:
        """Samples those steps consumed, all ranks together."""
        return self._state.samples

    @property
    def meta(self) -> dict[str, Any]:
        """Saved and restored with the state (JSON-like values)."""
        return self._state.meta

    @property
    def global_batch(self) -> int:
        """Samples the whole group takes in the current step."""
        return self._loop.global_batch

    def _ledger_now(self) -> Ledger:
        return self._goodput.ledger

    @property
    def ledger(self) -> Ledger:
        """Where each second of the run went so far (goodput/ledger.py): training, start-up,
        pauses by cause, work lost, checkpoint stalls. Every rank keeps it; rank 0's is
        the job's ``status.goodput``."""
        return self._goodput.ledger

    @property
    def resyncs(self) -> int:
        """Times rank 0's state was copied over a divergence."""
        return self._agreement.resyncs

    @property
    def ddp(self) -> DistributedDataParallel:
        """The current round's DDP module (after ``wrap``; a sharded model has none)."""
        if isinstance(self._replica, DDPReplication):
            return self._replica.model.ddp
        if self._replica is not None:
            raise RuntimeError("a sharded model has no DDP: use the model run.shard() returned")
        raise RuntimeError("call run.wrap(model, optimizer, sampler) first")

    @property
    def sampler(self) -> ElasticSampler:
        """The sampler given to ``wrap`` or ``shard``."""
        return self._loop.sampler

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
        """Build the process group, restore (from a peer's memory or a checkpoint), wrap
        ``model`` in DDP, and register the three for checkpoints and in-place recovery.

        ``state`` names every other object that changes during training and has
        ``state_dict()``/``load_state_dict()`` (torch's Stateful: LR schedulers,
        GradScalers, EMA models, extra optimizers, your own classes): each is saved,
        restored, sent to joining and lagging workers and fingerprinted with the model.
        """
        st = self._state
        st.registered = registered_state(state or {})
        st.module, st.optimizer, st.sampler = model, optimizer, sampler
        for optim in (optimizer, *st.registered.values()):
            if isinstance(optim, torch.optim.Optimizer):
                self._hook_optimizer(optim)
        current = CurrentDDP(model, ddp_kwargs, self._loop.vote, self._loop.forward_allowed)
        self._use(DDPReplication(st, self.ckpt, current))
        return current

    def shard(
        self,
        build: Build,
        sampler: ElasticSampler,
        copy_every: int = DEFAULT_COPY_EVERY,
        shard_group_size: int | None = None,
    ) -> Sharded:
        """A model sharded with FSDP2, elastic in place: ``build(mesh)`` shards the model
        on the round's device mesh and makes its optimizer (and schedulers), and is
        called again for each round (on the meta device when the shards move from
        peers' memory). Returns ``(model, optimizer, state)``: names for the current
        round's objects, ``state`` the third value ``build`` returned, by name::

            def build(mesh):
                model = GPT(cfg)
                for block in model.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
                optim = torch.optim.AdamW(model.parameters(), lr=3e-4)
                return model, optim, {"scheduler": LambdaLR(optim, warmup)}

            model, optim, state = run.shard(build, sampler)

        Each round is built under ``torch.manual_seed(seed)`` (the Run's seed), so every
        rank starts from the same model. Every ``copy_every`` steps each rank copies its
        shards to a peer's memory, so a lost rank sends the group back to that step, not
        to the disk (0: no copies; shard_copies.py). Checkpoints are DCP, every rank
        writing its own shards to the checkpoint directory, which every rank must reach
        (docs/training-loop.md, "Sharded models").

        ``shard_group_size`` makes it HSDP: ``mesh`` is 2-D, ``(replicate, shard)``, each
        replica sharded over groups of that many ranks (more when the world is not a
        multiple of it: mesh_shape.py); every shard is then held by every replica, so a
        lost rank costs no step while another replica holds its shard, and no shard
        copies are taken."""
        if copy_every < 0:
            raise ValueError(f"copy_every must be 0 (no shard copies) or more (got {copy_every})")
        if shard_group_size is not None and (
            isinstance(shard_group_size, bool)
            or not isinstance(shard_group_size, int)
            or shard_group_size < 1
        ):
            raise ValueError(
                "shard_group_size must be a whole number of ranks, 1 or more, or None for "
                f"FSDP over the whole world (got {shard_group_size!r})"
            )
        if self._replica is not None:
            raise RuntimeError("the model is wrapped already: call run.wrap or run.shard once")
        self._state.sampler = sampler
        self.ckpt.untrack()  # sharded state is saved by every rank together, not on SIGTERM
        checkpoints = ShardedCheckpoints(
            self.ckpt.directory, self.ckpt.keep, background=self.ckpt.async_save
        )
        # a hand-over finishes this rank's part of a save in flight
        self._rounds.on_leave = checkpoints.wait_own_part
        replica = FSDPReplication(
            build,
            self._state,
            checkpoints,
            self._hook_optimizer,
            self._loop.seed,
            copy_every,
            shard_group_size,
            self.device,
        )
        self._use(replica)
        self._loop.vote.stopping = lambda: self.ckpt.stop_requested  # stops are agreed
        registered = self._state.registered
        return Sharded(
            Current(lambda: replica.model, "model"),
            Current(lambda: replica.optimizer, "optimizer"),
            {
                name: Current(partial(registered_now, self._state, name), name)
                for name in registered
            },
        )

    def _hook_optimizer(self, optim: torch.optim.Optimizer) -> None:
        # the vote first: while it is read, no update has begun (a SIGTERM saves)
        optim.register_step_pre_hook(self._loop.count_vote)
        self.ckpt.guard_updates(optim)  # a SIGTERM save never catches it mid-update
        optim.register_step_post_hook(self._loop.note_update)

    def _use(self, replica: Replication) -> None:
        """Form the first round with the model laid out as ``replica`` says."""
        self._replica = self._loop.replica = replica
        self._build_group()
        self.sampler.reshard(self.rank, self.world_size)
        self._form()
        self._rounds.watch()
        if self._weigh_by_samples:  # the loader was made before the model
            replica.weigh_by_samples(self._loop)

    def _build_group(self) -> None:
        """The first round's process group, built once: at wrap/shard, so a worker that
        joins or replaces one builds its model before its peers wait for it."""
        self._end_on_demand()
        took = self._rounds.build_first()
        if took:
            self.timings["process_group"] = took

    def _group_asked_early(self) -> None:
        warnings.warn(EARLY_GROUP, FutureWarning, stacklevel=2)
        self._build_group()

    def _form(self) -> None:
        """Bring every rank to the newest step, with the model wrapped for this round.

        Not checked here: the check at the first step after it (the agreement's
        ``next_reason``) sees whatever this left different, and what never went
        through the Run besides, so a check here too was one more fingerprint of all
        the state and one more collective on the group's time (3-7 ms of a 0.1 s join
        in the regression example, 40-70 ms in the realistic one)."""
        assert self._replica is not None
        ledger = offer(self._goodput, self._goodput_held)
        formed = gather_formation(ledger, self._replica.holding(), self._rounds.device)
        self._rounds.take_token(formed.token)
        self.resumed_from = self._replica.form(self._rounds, self.timings, formed.holdings)
        sync_ledger(
            self._goodput, ledger, formed.ledgers, self.rank, self._rounds.device, read_published
        )
        self._goodput.formed(self.world_size)
        self._goodput_held = Held.SURVIVOR  # the next group's: this copy lived through a form
        self._agreement.next_reason = "the first step after the group formed"

    # -- the loop

    def epochs(self, count: int, max_steps: int | None = None) -> Iterator[int]:
        """Epochs from the restored one up to ``count`` (or until ``max_steps``)."""
        return self._loop.epochs(count, max_steps)

    def batches(self, fetch: Callable[[list[int]], Batch], batch_size: int) -> Iterator[Batch]:
        """This rank's batch for each step left in the epoch: ``fetch(indices)``.

        :meth:`loader` does the same with a torch ``DataLoader`` (worker processes,
        prefetch, no empty batches); this is the plain form, in the training thread."""
        return self._loop.batches(fetch, batch_size)

    def loader(self, dataset: Dataset[Any], batch_size: int, **options: Any) -> ElasticLoader:
        """A torch ``DataLoader`` over ``dataset`` that yields this rank's batch for each
        step. ``options``: ``accumulate`` (micro-batches of ``batch_size`` per step, above
        1: train them in one ``with run.step():`` through :meth:`accumulate`) and
        DataLoader's ``num_workers``, ``collate_fn``, ``pin_memory``,
        ``persistent_workers``, ``prefetch_factor``, ``worker_init_fn``,
        ``multiprocessing_context``. Worker processes are persistent by default, start
        when the loader is made and survive regroups; loader.py says how. ``dataset`` is
        the one the sampler was made for.

        Best made before the model: the workers are then forked from a small process,
        and nothing the trainer writes later is copy-on-write (a joining worker's first
        step took 0.6 s less here, docs/training-loop.md). After :meth:`wrap` works too."""
        refused = refused_option(options)
        if refused is not None:
            raise TypeError(refused)
        made = ElasticLoader(self._loop, dataset, batch_size, seed=self._item_seed, **options)
        self._weigh_by_samples = True
        if self._replica is not None:
            self._replica.weigh_by_samples(self._loop)
        return made

    def _item_seed(self) -> int:
        """The seed the loader reads items under: the Run's, else the sampler's."""
        return self.sampler.seed if self._loop.seed is None else self._loop.seed

    def accumulate(self, micro_batches: Sequence[Batch]) -> Iterator[Batch]:
        """The step's micro-batches, each trained without reducing its gradients but the
        last (DDP's ``no_sync``, FSDP2's gradient sync off), so gradients are reduced once
        per step: ``for x, y in run.accumulate(batch):``."""
        if self._replica is None:
            raise RuntimeError("call run.wrap(...) or run.shard(...) first")
        last = len(micro_batches) - 1
        for i, micro in enumerate(micro_batches):
            if i < last:
                with self._replica.accumulating():
                    yield micro
            else:
                yield micro

    @property
    def rank_samples(self) -> int:
        """Samples this rank trains on in the current step: 0 for the filler batch a rank
        gets when the epoch's last step has fewer samples than ranks (loader.py)."""
        loop = self._loop
        return loop.rank_samples if loop.rank_samples is not None else loop.batch_size

    def step(self) -> contextlib.AbstractContextManager[StepOutcome]:
        """One optimizer step: committed when the block ends; dropped (and the group
        rebuilt) when a collective in it fails because the group broke. A dropped step
        leaves no gradient behind, wherever the script calls ``zero_grad``. After the
        block, ``outcome.committed`` says whether the step counts and ``outcome.regrouped``
        whether this rank has moved to another group since it began (a collective of
        your own after the block belongs only where it is False)."""
        return self._loop.step()

    def _committed(self) -> None:
        """After each commit: a SIGTERM saves this step and exits 143; the interval's
        checkpoint; rank 0's progress record. A sharded model's ranks save together, so
        a rank told to stop goes on until the ranks agree on a step (its next vote) and
        they all save it; ranks not told to stop then train on."""
        step = self.global_step
        self._goodput.committed(step)  # before anything below can end the process
        stop_here = True
        if self._replica is not None and self._replica.saves_together:
            stop_here = self._loop.stop_agreed()
            if stop_here:
                self.save(wait=True)
                self.ckpt.saved_elsewhere(step)
                log.warning("a rank was told to stop: every rank saved step %d", step)
        if stop_here:
            self.ckpt.mark_step(step)
        else:  # a keyword only here: a script's own wrapper of mark_step keeps working
            self.ckpt.mark_step(step, stop_here=False)
        if step % self.checkpoint_interval == 0:
            self.save()
            self._goodput.saved()  # the save's time on this thread: checkpoint time
        if self.reporter is not None:
            self.reporter.update(
                step,
                self.global_batch,
                epoch=self.sampler.epoch,
                checkpoint_step=self._replica.saved_step if self._replica else None,
                world_size=self.world_size,
                checkpoint_error=self.ckpt.save_error,
                ledger=self._ledger_now,  # read in the publisher's thread, not here
            )

    def save(self, *, wait: bool = False) -> None:
        """Checkpoint the current step now (e.g. at an epoch's end), besides the interval;
        every rank calls it. ``wait``: return only once the checkpoint is written (and,
        sharded, committed), e.g. before the script exits without :meth:`finish`.

        A save that failed on a full or read-only directory is tried again at the next
        call (its error is in ``ckpt.save_error`` and the job's progress)."""
        if self._replica is None:
            raise RuntimeError("call run.wrap(...) or run.shard(...) first")
        self._replica.save(self.global_step)
        if wait:
            self.ckpt.wait()
            self._replica.flush_saves()

    # -- regrouping (worker_rounds.py)

    def _regroup(self, failed: bool) -> None:
        """Leave this round's group and join the next one, keeping everything in memory."""
        # The old DDP (and through it the old group) is dropped only once the next round
        # stands: freeing it joins gloo's threads, and one of them may still be finishing
        # the aborted work, which needs the GIL this thread would hold while it waits.
        assert self._replica is not None
        self._goodput.regroup_began()
        old_world = self.world_size
        if self.rank == 0:  # its copy is the one published so far: the group keeps it
            self._goodput_held = Held.PUBLISHER
        retired = [self._replica.retire()]

        def rebuild(timings: dict[str, float]) -> None:
            told = self._rounds.assignment.env.get(contract.ROUND_CAUSE)  # the opener's why
            self._goodput.group_changed(regroup_cause(failed, old_world, self.world_size, told))
            self.timings.clear()  # the same dict the step loop writes into
            self.timings.update(timings)
            self.sampler.reshard(self.rank, self.world_size)
            self._form()

        # while it waits, a SIGTERM saves this step and exits 143
        took = self._rounds.regroup(failed, lambda: self.ckpt.mark_step(self.global_step), rebuild)
        retired.clear()
        self.regroups += 1
        self._goodput.regrouped()
        log.warning(
            "regrouped in place: rank %d of %d at step %d in %.2f s",
            self.rank,
            self.world_size,
            self.global_step,
            took,
        )
        self.reporter = reporter_for_rank(self.rank, self.reporter)
        # its checkpoints go to the directory from rank 0 as it is now: fixed at the start,
        # nobody wrote there once the first rank 0 was gone (a full restart lost the rest)
        self.ckpt.writer = self.rank == 0
        if self._on_regroup is not None:
            self._on_regroup(self)

    # -- the end

    def finish(self) -> None:
        """Save the last step, withdraw the progress record, and leave the group."""
        self._end_on_demand()
        if self.ckpt.stop_requested:
            self.ckpt.mark_step(self.global_step)  # SIGTERM during the last step: save, exit 143
        if self._state.live:
            self.ckpt.wait()  # an interval save of this step that failed is made again
            self.save(wait=True)
        self._rounds.settle(lambda: self._regroup(failed=False))
        self.ckpt.close()
        self._goodput.finished()
        if self.reporter is not None:
            self.reporter.update_ledger(self._goodput.ledger)
            self.reporter.close()
        self._rounds.close()

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
