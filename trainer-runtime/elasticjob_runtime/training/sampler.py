"""ElasticSampler: every sample exactly once per epoch, across any number of resizes.

torch's ``ElasticDistributedSampler`` restarts a resized epoch by reshuffling the
*dataset indices* from ``start_index`` on and pads ranks to equal length, so a
resize mid-epoch repeats some samples and skips others. Here the epoch's order is
a permutation fixed by ``(seed, epoch)``, and the position in it is the *global*
number of samples consumed so far. Rank ``r`` of ``w`` takes the remaining
positions ``consumed + r, consumed + r + w, ...``; after ``k`` steps of ``b``
samples per rank the ranks together have taken exactly positions
``[consumed, consumed + k*w*b)``, so the consumed count is all the state a
restart needs, whatever the new world size.

How a training loop uses it::

    sampler = ElasticSampler(len(dataset), seed=0)    # rank/world from the process group
    loader = DataLoader(dataset, batch_size=b, sampler=sampler)
    sampler.load_state_dict(ckpt["sampler"])          # when resuming
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)                      # keeps the position on resume
        for batch in loader:
            train_step(batch)
            sampler.advance(world * b)                # once per optimizer step, same on all ranks
            checkpoints.save({"model": model, "sampler": sampler, ...}, step)

``advance`` clamps at the end of the epoch, so the last (short) global batch needs
no special case. When the samples left in the epoch are fewer than ``world * b``
but some ranks get none, those ranks run one batch fewer; wrap the loop in DDP's
``model.join()`` (torch.distributed.algorithms.Join) to tolerate that.

The index arithmetic is in plain functions so it can be property-tested.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

_SEED_MIX = 1_000_003
_SEED_MASK = (1 << 63) - 1


def rank_positions(num_samples: int, consumed: int, rank: int, world_size: int) -> range:
    """Positions in the epoch's order that ``rank`` takes, given ``consumed`` globally."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if not 0 <= consumed <= num_samples:
        raise ValueError(f"consumed must be in [0, {num_samples}], got {consumed}")
    return range(consumed + rank, num_samples, world_size)


def advance_consumed(num_samples: int, consumed: int, global_batch: int) -> int:
    """The consumed count after a step of ``global_batch`` samples (clamped to the epoch)."""
    if global_batch < 0:
        raise ValueError(f"global_batch must be >= 0, got {global_batch}")
    return min(num_samples, consumed + global_batch)


def epoch_seed(seed: int, epoch: int) -> int:
    """Generator seed for an epoch; distinct (seed, epoch) pairs rarely collide."""
    return (seed * _SEED_MIX + epoch) & _SEED_MASK


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The epoch's order of dataset indices: a permutation fixed by (seed, epoch)."""
    if not shuffle:
        return list(range(num_samples))
    gen = torch.Generator()
    gen.manual_seed(epoch_seed(seed, epoch))
    order: list[int] = torch.randperm(num_samples, generator=gen).tolist()
    return order


def rank_indices(order: Sequence[int], consumed: int, rank: int, world_size: int) -> list[int]:
    """Dataset indices ``rank`` reads for the rest of the epoch."""
    return [order[p] for p in rank_positions(len(order), consumed, rank, world_size)]


def _current_rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class ElasticSampler(Sampler[int]):
    """A ``Sampler`` whose position survives a change of world size (see module doc)."""

    def __init__(
        self,
        num_samples: int,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        """``rank``/``world_size`` default to the process group's (or RANK/WORLD_SIZE)."""
        if rank is None or world_size is None:
            default_rank, default_world = _current_rank_and_world()
            rank = default_rank if rank is None else rank
            world_size = default_world if world_size is None else world_size
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        rank_positions(num_samples, 0, rank, world_size)  # validates rank/world_size
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.consumed = 0

    def reshard(self, rank: int, world_size: int) -> None:
        """Take ``rank``'s share of a new world from the current position on (the epoch
        and position are global, so nothing else changes)."""
        rank_positions(self.num_samples, self.consumed, rank, world_size)  # validates
        self.rank, self.world_size = rank, world_size

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch``; the position resets only when the epoch changes."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0

    def advance(self, global_batch: int) -> None:
        """Record that all ranks together consumed ``global_batch`` more samples."""
        self.consumed = advance_consumed(self.num_samples, self.consumed, global_batch)

    @property
    def remaining(self) -> int:
        """Samples of this epoch not yet consumed by any rank."""
        return self.num_samples - self.consumed

    def __iter__(self) -> Iterator[int]:
        order = epoch_order(self.num_samples, self.seed, self.epoch, self.shuffle)
        return iter(rank_indices(order, self.consumed, self.rank, self.world_size))

    def __len__(self) -> int:
        return len(rank_positions(self.num_samples, self.consumed, self.rank, self.world_size))

    def state_dict(self) -> dict[str, int | bool]:
        """Global position only: rank and world size are the new round's, not saved."""
        return {
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "consumed": self.consumed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the saved epoch and position; refuses a state for another dataset/order."""
        saved = int(state["num_samples"])
        if saved != self.num_samples:
            raise ValueError(
                f"sampler state is for {saved} samples but this dataset has "
                f"{self.num_samples}; start a new run or restore the matching dataset"
            )
        if int(state["seed"]) != self.seed or bool(state["shuffle"]) != self.shuffle:
            raise ValueError(
                "sampler state was saved with seed/shuffle "
                f"{state['seed']}/{state['shuffle']}, this sampler has "
                f"{self.seed}/{self.shuffle}; pass the same seed and shuffle to resume"
            )
        self.epoch = int(state["epoch"])
        self.consumed = advance_consumed(self.num_samples, int(state["consumed"]), 0)
