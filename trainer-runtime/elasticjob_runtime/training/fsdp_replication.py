"""FSDP2 and HSDP shards: the model rebuilt on each round's mesh, its shards moved between
ranks' memory.

FSDP2 binds a module to a device mesh, and the mesh is the round's world (1-D for FSDP2;
``(replicate, shard)`` for HSDP, its shape from mesh_shape.py), so every round builds the
model anew through the script's ``build(mesh)`` (which calls ``fully_shard`` and makes the
optimizer and schedulers): on the ``meta`` device when the survivors hold every shard of
the newest step (with HSDP, in any replica), so no rank allocates more than its new shard.
Then:

* **in memory** (a join, a planned resize: every old rank's shard is held by a survivor
  at the newest step): each parameter and each piece of optimizer state moves row by
  row to the ranks that own it now (reshard.py), one tensor at a time; what is replicated
  (sampler position, step counters, schedulers, the optimizer's hyper-parameters and
  step counts, the module's buffers) comes from the lowest rank at the newest step;
* **from the shard copies** (shard_copies.py) when a shard was lost with its rank (a
  killed worker or a lost node: pure FSDP keeps one copy of each shard): every
  ``copy_every`` steps each rank keeps a snapshot of its shards and a copy of its
  predecessor's, so the group goes back to the newest step whose every shard a survivor
  holds, and the shards move from there as above;
* **from the newest DCP checkpoint** (checkpoints/sharded.py) when the copies cannot
  rebuild a step (two neighbours lost, or no copies) or the checkpoint is newer, in place
  all the same: the survivors keep their processes;
* **fresh** when nobody holds a step and there is no checkpoint: every rank builds the
  model under the same seed, so every rank starts from the same model.

What the ranks compare (agreement.py) is what is replicated, and with HSDP each shard
among the replicas that hold it; otherwise each rank's shards differ by design.
Checkpoints are DCP, every rank writing its own shards.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from elasticjob_runtime.checkpoints.format import deserialize, serialize
from elasticjob_runtime.checkpoints.sharded import ShardedCheckpoints
from elasticjob_runtime.checkpoints.state_transfer import broadcast_bytes
from elasticjob_runtime.training.agreement import gather_rows
from elasticjob_runtime.training.fsdp_reduce_scatter import (
    WeighedReduceScatter,
    fsdp_modules,
    install,
)
from elasticjob_runtime.training.grad_allreduce import Shares
from elasticjob_runtime.training.mesh_shape import MeshShape, mesh_shape, shape_note
from elasticjob_runtime.training.optimizer_state import make_state, sharded_layout
from elasticjob_runtime.training.reshard import (
    ShardMove,
    complete_holders,
    exchange_all,
    old_shards_of,
    own_shards,
)
from elasticjob_runtime.training.sampler import ElasticSampler
from elasticjob_runtime.training.shard_copies import (
    NO_COPIES,
    CopyHolding,
    Snapshot,
    copy_holders,
    swap_with_buddy,
    take,
)
from elasticjob_runtime.training.state import TrainingState, registered_state, sampler_position
from elasticjob_runtime.training.worker_rounds import WorkerRounds

log = logging.getLogger(__name__)

# build(mesh) -> (model, optimizer) or (model, optimizer, {name: Stateful})
Build = Callable[[Any], tuple[Any, ...]]


@dataclass
class HeldShards:
    """What a rank keeps of a round it leaves: its shard (index ``shard`` of the
    ``shards`` the state was cut into) and the replicated state."""

    step: int
    shard: int
    shards: int
    pieces: dict[str, torch.Tensor] = field(default_factory=dict)  # piece_name -> local rows
    replicated: bytes = b""


def piece_name(*parts: str) -> str:
    """One sharded tensor's name: ``model/<fqn>`` or ``optim/<fqn>/<state key>``."""
    return "/".join(parts)


def sharded_pieces(msd: Mapping[str, Any], osd: Mapping[str, Any]) -> dict[str, Any]:
    """Every DTensor of a model's and its optimizer's state dicts, by :func:`piece_name`."""
    mine = sharded_entries(msd, osd)
    out = {piece_name("model", fqn): v for fqn, v in mine["model"].items()}
    for fqn, entries in mine["optim"].items():
        out.update({piece_name("optim", fqn, key): v for key, v in entries.items()})
    return out


def round_dims(generation: int, hsdp: bool) -> tuple[str, ...]:
    """The names of a round's mesh dimensions, its own each round. torch's DTensor caches
    its sharding decisions by mesh, and two meshes of one shape are equal whatever rank
    this process has in them (torch 2.13): a rank that moved from 0 to 1 got its old
    round's mesh, and its shards claimed rank 0's rows. A name per round tells them apart."""
    shard = f"shard_round{generation}"
    return (f"replicate_round{generation}", shard) if hsdp else (shard,)


def why_not_in_memory(held: list[tuple[int, int, int]], newest: int) -> str:
    """Why the survivors cannot rebuild step ``newest`` from memory, in one clause."""
    shards = old_shards_of(held, newest)
    at_newest = {old for step, old, _ in held if step == newest}
    behind = sorted({old for step, old, n in held if n == shards and old >= 0} - at_newest)
    lost = sorted(set(range(shards)) - at_newest - set(behind))
    if lost:
        return (
            f"shard(s) {lost} of step {newest} (of {shards}) were lost with every process "
            "that held them"
        )
    return f"shard(s) {behind} are held only at an older step than {newest}"


def is_sharded(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def model_state(model: nn.Module) -> dict[str, Any]:
    """The model's state dict by name: DTensors for its shards, tensors for its buffers."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return dict(get_model_state_dict(model))


def made_optimizer_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict by parameter name, its state made first if it has none
    (torch steps it once with zero gradients and no learning rate): a target to fill."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return dict(get_optimizer_state_dict(model, optim))


def hyper_parameters(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An optimizer's param groups without their parameters: what every rank holds alike."""
    return [{k: v for k, v in group.items() if k != "params"} for group in groups]


def sharded_entries(msd: Mapping[str, Any], osd: Mapping[str, Any]) -> dict[str, Any]:
    """The DTensors of a model's and its optimizer's state dicts, by name: what each rank
    holds of its own (``optim`` also has each parameter's replicated step count)."""
    return {
        "model": {fqn: v for fqn, v in msd.items() if is_sharded(v)},
        "optim": {
            fqn: {k: v for k, v in entries.items() if is_sharded(v)}
            for fqn, entries in osd["state"].items()
        },
    }


def optimizer_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict by parameter name; one that never stepped has no
    state, and stays so (torch's ``get_optimizer_state_dict`` would step it to make one,
    which changes its step count)."""
    if optim.state:
        return made_optimizer_state(model, optim)
    return {"state": {}, "param_groups": hyper_parameters(optim.param_groups)}


def built_parts(built: Any) -> tuple[nn.Module, torch.optim.Optimizer, Mapping[str, Any]]:
    """``build(mesh)``'s result, checked: one clear line for each mistake."""
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        raise TypeError(
            f"build(mesh) returned a {type(built).__name__}; return (model, optimizer) or "
            "(model, optimizer, {'name': stateful, ...}) for the schedulers and the like"
        )
    model, optimizer = built[0], built[1]
    extra: Mapping[str, Any] = built[2] if len(built) == 3 else {}
    if not isinstance(model, nn.Module) or not fsdp_modules(model):
        raise TypeError(
            "build(mesh) must return a model that fully_shard(..., mesh=mesh) was applied "
            f"to (got a {type(model).__name__} with no FSDP2 module in it); for a model "
            "replicated whole, use run.wrap(model, optimizer, sampler)"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"build(mesh)'s second value is a {type(optimizer).__name__}, not a "
            "torch.optim.Optimizer built over the sharded model's parameters"
        )
    return model, optimizer, extra


def someone_leaves(rounds: WorkerRounds) -> bool:
    """Do ranks leave the job after this step? One small all-gather, at a step the ranks
    agreed to switch after: a rank that voted to switch knows why (its node leaves, or
    its agent's next round is smaller), though its peers may not yet."""
    return any(row[0] for row in gather_rows([int(rounds.sees_departure())], rounds.device))


class FSDPReplication:
    """:class:`~elasticjob_runtime.training.replication.Replication` for FSDP2 and HSDP."""

    saves_together = True  # each rank writes its own shards of one checkpoint

    def __init__(
        self,
        build: Build,
        state: TrainingState,
        checkpoints: ShardedCheckpoints,
        on_optimizer: Callable[[torch.optim.Optimizer], None],
        seed: int | None,
        copy_every: int = 0,
        shard_group_size: int | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``device``: where the shards live (the Run's device; default the round group's,
        the CPU for gloo). The mesh is of its type, so gloo over CUDA shards works too."""
        self._build, self._state, self.checkpoints = build, state, checkpoints
        self._device = device
        self._on_optimizer, self._seed = on_optimizer, seed
        self._comm = WeighedReduceScatter()
        self._held: HeldShards | None = None
        self._rank = 0
        self.shard_group_size = shard_group_size  # None: FSDP2; a size: HSDP (mesh_shape.py)
        self.shape = MeshShape(1, 1)  # the round's
        self._mesh: Any = None
        self._noted: set[str] = set()  # shape notes logged once each
        self.copy_every = copy_every  # shard_copies.py; 0: no copies
        self._own: Snapshot | None = None  # this rank's shards at the last copy
        self._buddy: Snapshot | None = None  # its predecessor's, at the same step

    # -- the round's model

    @property
    def model(self) -> nn.Module:
        if self._state.module is None:
            raise RuntimeError("call run.shard(build, sampler) first")
        return self._state.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        if self._state.optimizer is None:
            raise RuntimeError("call run.shard(build, sampler) first")
        return self._state.optimizer

    def _make(self, rounds: WorkerRounds, on_meta: bool) -> None:
        """Build the model, optimizer and registered state on this round's mesh."""
        from torch.distributed.device_mesh import init_device_mesh

        self._state.module = self._state.optimizer = None  # the old round's go first
        self._state.registered = {}
        self._mesh = None
        hsdp = self.shard_group_size is not None
        shape = mesh_shape(rounds.world_size, self.shard_group_size)
        note = shape_note(shape, self.shard_group_size)
        if note is not None and note not in self._noted:
            self._noted.add(note)
            log.warning("%s", note)
        with rounds.group.adopt():  # an abandoned round shuts its sub-groups too
            mesh = init_device_mesh(
                self._compute_device(rounds).type,
                (shape.replicas, shape.shard) if hsdp else (shape.shard,),
                mesh_dim_names=round_dims(rounds.generation, hsdp),
            )
        self.shape, self._mesh = shape, mesh
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0 if self._seed is None else self._seed)
            if on_meta:
                with torch.device("meta"):
                    model, optimizer, extra = built_parts(self._build(mesh))
                model.to_empty(device=self._compute_device(rounds))
            else:
                model, optimizer, extra = built_parts(self._build(mesh))
        install(model, self._comm)
        st = self._state
        st.module, st.optimizer, st.registered = model, optimizer, registered_state(extra)
        for optim in (optimizer, *st.registered.values()):
            if isinstance(optim, torch.optim.Optimizer):
                self._on_optimizer(optim)

    def _compute_device(self, rounds: WorkerRounds) -> torch.device:
        return self._device if self._device is not None else rounds.device

    # -- Replication

    def holding(self) -> list[int]:
        """The step, shard and shard count this rank holds in memory (-1, -1, 0: none),
        then what it holds of its peers' shard copies."""
        held = self._held
        mine = [held.step, held.shard, held.shards] if held else [-1, -1, 0]
        return [*mine, *self._copies().row()]

    def form(
        self, rounds: WorkerRounds, timings: dict[str, float], rows: Sequence[Sequence[int]]
    ) -> str:
        started = time.monotonic()
        held = self._held
        holdings = [(r[0], r[1], r[2]) for r in rows]
        newest = max(step for step, _, _ in holdings)
        holders = complete_holders(holdings, newest) if newest >= 0 else None
        rollback = None
        if holders is None:  # also when a rollback broke while forming: nobody holds a step
            rollback = copy_holders([CopyHolding(*r[3:]) for r in rows])
            if rollback is not None and rollback.step < self.checkpoints.newest_step(rounds.device):
                rollback = None  # the checkpoint is newer than the copies
        if rollback is not None:
            self._held = None  # a step nobody can rebuild: its memory goes to the new shards
        self._make(rounds, on_meta=holders is not None or rollback is not None)
        built = time.monotonic()
        if holders is not None:
            src = min(holders.values())
            pieces = {held.shard: held.pieces} if held else {}
            data = held.replicated if held and rounds.rank == src else b""
            old_shards = old_shards_of(holdings, newest)
            kept = own_shards(holdings, newest)
            self._reshard(pieces, data, holders, old_shards, rounds, src, kept)
            resumed = (
                f"own memory at step {newest}"
                if held and held.step == newest
                else f"rank {src} at step {newest}"
            )
        elif rollback is not None:
            why = (
                why_not_in_memory(holdings, newest)
                if newest >= 0
                else "the last round broke while it formed"
            )
            if rollback.step == newest:  # a leaver's copy, taken at its last step
                log.info("%s; a survivor holds a copy of them at that step", why)
            else:
                log.warning(
                    "%s; the group goes back to step %d, whose every shard a survivor "
                    "holds (shard copies)",
                    why,
                    rollback.step,
                )
            own, buddy = self._own, self._buddy
            pieces = {s.rank: s.tensors() for s in (own, buddy) if s is not None}
            src = rollback.source
            data = own.replicated if own is not None and rounds.rank == src else b""
            self._reshard(pieces, data, rollback.holders, rollback.world, rounds, src)
            resumed = f"shard copies at step {rollback.step}"
        else:
            if newest >= 0:
                log.warning(
                    "%s; every rank reads the newest checkpoint",
                    why_not_in_memory(holdings, newest),
                )
            resumed = self._restore(rounds)
        self._held = None
        if self.copy_every < 1:
            self._own = self._buddy = None  # a leaver's copy, used: none are kept
        self._rank = rounds.rank
        self._state.live = True
        timings["build"] = built - started
        timings["restore"] = time.monotonic() - built
        return resumed

    def retire(self) -> object | None:
        """Keep this rank's shards and the replicated state; drop the model."""
        st = self._state
        if st.module is None or not st.live:
            return None
        model, optim = self.model, self.optimizer
        for module in fsdp_modules(model):
            module.reshard()  # type: ignore[operator]  # a step dropped mid-forward
        msd = model_state(model)
        osd = optimizer_state(model, optim)
        held = HeldShards(st.step, self.shape.shard_index(self._rank), self.shape.shard)
        held.pieces = {name: v.to_local() for name, v in sharded_pieces(msd, osd).items()}
        held.replicated = serialize(self._replicated(model, osd))
        self._held = held
        st.module = st.optimizer = None
        st.registered = {}
        return (model, optim)

    def checked(self) -> dict[str, Any]:
        st = self._state
        assert st.sampler is not None
        return {
            "optim.param_groups": hyper_parameters(self.optimizer.param_groups),
            "sampler": sampler_position(st.sampler),
            "run": {"step": st.step, "samples": st.samples},
            **st.registered,
        }

    def checked_within_replicas(self) -> tuple[int, dict[str, Any]]:
        """HSDP: the shards, which every replica holds alike; pure FSDP: nothing (no two
        ranks hold the same shard)."""
        index = self.shape.shard_index(self._rank)
        if self.shape.replicas < 2:
            return index, {}
        model, optim = self.model, self.optimizer
        pieces = sharded_pieces(model_state(model), optimizer_state(model, optim))
        return index, {"shards": {name: v.to_local() for name, v in pieces.items()}}

    def resync(self, rounds: WorkerRounds) -> None:
        """Every rank takes rank 0's replicated state (its shards are its own); with HSDP
        every replica takes the first replica's shards too."""
        model, optim = self.model, self.optimizer
        if self.shape.replicas > 1:
            self._resync_shards(model, optim)
        data = (
            serialize(self._replicated(model, optimizer_state(model, optim)))
            if rounds.rank == 0
            else b""
        )
        replicated = deserialize(broadcast_bytes(data, 0, rounds.device), source="rank 0")
        if rounds.rank != 0:
            self._load_replicated(replicated, optimizer_state(model, optim))

    def weigh_by_samples(self, shares: Shares) -> None:
        self._comm.shares = shares

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        roots = fsdp_modules(self.model)
        for module in roots:
            module.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            for module in roots:
                module.set_requires_gradient_sync(True)  # type: ignore[operator]

    @property
    def saved_step(self) -> int | None:
        return self.checkpoints.saved_step

    def save(self, step: int) -> None:
        if step in (self.checkpoints.saved_step, self.checkpoints.pending_step):
            return
        model, optim = self.model, self.optimizer
        msd = model_state(model)
        osd = made_optimizer_state(model, optim)
        replicated = serialize(self._replicated(model, osd))
        self.checkpoints.save(step, sharded_entries(msd, osd), replicated)

    def flush_saves(self) -> None:
        self.checkpoints.close()

    def committed(self, step: int, rounds: WorkerRounds, switching: bool) -> None:
        """Every ``copy_every`` steps, and at the last step of a rank that leaves: a
        snapshot of this rank's shards, and a copy of them to its buddy
        (shard_copies.py), so that a departure announced ahead costs no step. Not with
        HSDP replicas: every shard is held by another replica already."""
        if self.shape.replicas > 1:
            self._own = self._buddy = None  # an older round's copies: no longer kept fresh
            return
        if rounds.world_size < 2:
            return
        due = self.copy_every >= 1 and step % self.copy_every == 0
        if not due and not (switching and someone_leaves(rounds)):
            return
        # The last copy's buffers take the new one; until it is whole this rank reports
        # none: a copy that breaks leaves none, never a mix of two steps.
        old_own, old_buddy = self._own, self._buddy
        self._own = self._buddy = None
        model, optim = self.model, self.optimizer
        msd, osd = model_state(model), optimizer_state(model, optim)
        local = {
            name: (v.to_local(), int(v.shape[0])) for name, v in sharded_pieces(msd, osd).items()
        }
        replicated = serialize(self._replicated(model, osd))
        own = take(step, rounds.rank, rounds.world_size, local, replicated, old_own)
        del old_own
        buddy = swap_with_buddy(own, rounds.device, old_buddy, lambda: rounds.abandoned)
        self._own, self._buddy = own, buddy

    def _copies(self) -> CopyHolding:
        own, buddy = self._own, self._buddy
        if own is None or buddy is None:
            return NO_COPIES
        return CopyHolding(own.step, own.world, own.rank, buddy.rank)

    # -- moving state

    def _replicated(self, model: nn.Module, osd: Mapping[str, Any]) -> dict[str, Any]:
        """Everything every rank holds the same: what a joiner copies, what a sharded
        checkpoint keeps beside the shards."""
        st = self._state
        assert st.sampler is not None
        return {
            "run": {"step": st.step, "samples": st.samples, "meta": dict(st.meta)},
            "sampler": st.sampler.state_dict(),
            "registered": {name: obj.state_dict() for name, obj in st.registered.items()},
            "param_groups": osd["param_groups"],
            "optim_scalars": {
                fqn: {k: v for k, v in entries.items() if not is_sharded(v)}
                for fqn, entries in osd["state"].items()
            },
            "optim_layout": sharded_layout(self.optimizer, osd),
            "buffers": {name: b.detach().clone() for name, b in model.named_buffers()},
        }

    def _load_replicated(self, replicated: Mapping[str, Any], osd: dict[str, Any]) -> None:
        """Take the replicated state in; ``osd`` (the optimizer's, sharded entries filled)
        gets its hyper-parameters and step counts from it and is loaded."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        st, model = self._state, self.model
        if replicated["optim_scalars"]:
            osd["param_groups"] = replicated["param_groups"]
            for fqn, scalars in replicated["optim_scalars"].items():
                osd["state"].setdefault(fqn, {}).update(scalars)
            set_optimizer_state_dict(model, self.optimizer, osd)
        else:  # it never stepped: its hyper-parameters only (torch's loader would step it)
            saved = hyper_parameters(replicated["param_groups"])
            for group, values in zip(self.optimizer.param_groups, saved, strict=True):
                group.update(values)
        buffers = dict(model.named_buffers())
        with torch.no_grad():
            for name, value in replicated["buffers"].items():
                buffers[name].copy_(value)
        for name, obj in st.registered.items():
            obj.load_state_dict(replicated["registered"][name])
        sampler: ElasticSampler | None = st.sampler
        assert sampler is not None
        sampler.load_state_dict(replicated["sampler"])
        st.step = int(replicated["run"]["step"])
        st.samples = int(replicated["run"]["samples"])
        st.meta.clear()
        st.meta.update(replicated["run"]["meta"])

    def _reshard(
        self,
        pieces: Mapping[int, Mapping[str, torch.Tensor]],
        data: bytes,
        holders: Mapping[int, int],
        old_shards: int,
        rounds: WorkerRounds,
        src: int,
        own: Mapping[int, int] | None = None,
    ) -> None:
        """The replicated state (``data``) from rank ``src``, then every shard to its new
        owners, one tensor at a time: ``pieces`` are the rows this rank holds, by old
        shard (its own, or snapshots of its and its predecessor's); ``holders`` and
        ``own`` say who sends what (reshard.py). What it holds stays whole until the round
        stands: a group that breaks while forming tries again."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        model, rank, world = self.model, rounds.rank, rounds.world_size
        replicated = deserialize(broadcast_bytes(data, src, rounds.device), source=f"rank {src}")
        new_shards = self.shape.shard

        def move(targets: Mapping[str, Any]) -> None:
            """Every one of ``targets`` (piece name -> its DTensor on the new mesh)."""
            moves = [
                ShardMove(
                    {old: rows[name] for old, rows in pieces.items()}, t.to_local(), t.shape[0]
                )
                for name, t in targets.items()
            ]
            exchange_all(moves, old_shards, holders, rank, world, new_shards, own, rounds.device)

        msd = model_state(model)
        move({piece_name("model", fqn): msd[fqn] for fqn in sorted(msd) if is_sharded(msd[fqn])})
        set_model_state_dict(model, msd)
        osd: dict[str, Any] = {"state": {}, "param_groups": []}
        if replicated["optim_scalars"]:  # an optimizer that has stepped has state to move
            layout = replicated.get("optim_layout")
            if layout is not None:  # made without a step where it can be (optimizer_state.py)
                make_state(
                    self.optimizer, replicated["param_groups"], layout, replicated["optim_scalars"]
                )
            osd = made_optimizer_state(model, self.optimizer)  # state made, then filled
            move(
                {
                    piece_name("optim", fqn, key): entries[key]
                    for fqn, entries in sorted(osd["state"].items())
                    for key in sorted(entries)
                    if is_sharded(entries[key])
                }
            )
        self._load_replicated(replicated, osd)

    def _resync_shards(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        """Every replica's shards from the first replica's rank of the same shard, over
        the mesh's replicate groups, in place."""
        import torch.distributed as dist

        group = self._mesh.get_group(0)  # this rank's replicate group
        src = self.shape.shard_index(self._rank)  # its first replica's global rank
        pieces = sharded_pieces(model_state(model), optimizer_state(model, optim))
        with torch.no_grad():
            for name in sorted(pieces):
                dist.broadcast(pieces[name].to_local(), src=src, group=group)

    def _restore(self, rounds: WorkerRounds) -> str:
        """The newest sharded checkpoint, or a fresh start."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        step = self.checkpoints.newest_step(rounds.device)
        if step < 0:
            return "fresh"  # the optimizer stays without state, as a fresh one is
        model = self.model
        msd = model_state(model)
        osd = made_optimizer_state(model, self.optimizer)
        replicated = self.checkpoints.load(step, sharded_entries(msd, osd))
        set_model_state_dict(model, msd)
        self._load_replicated(replicated, osd)
        return f"checkpoint step {step}"
