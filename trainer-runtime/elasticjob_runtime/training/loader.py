"""``run.loader(dataset, ...)``: a torch ``DataLoader`` whose batches are the Run's steps.

A plain ``DataLoader`` over a ``DistributedSampler`` cannot follow an elastic group: its
worker processes prefetch batches of a shard that a regroup has just changed, and its
position is lost with the process. Here the ``DataLoader`` is given, for each round, the
exact list of this rank's batches for the rest of the epoch (``plan_steps``, from
:class:`~elasticjob_runtime.training.sampler.ElasticSampler`'s committed position), through a
batch sampler it re-reads whenever its iterator is reset. At a regroup, a restart of
the epoch or a dropped step, the Run resets the iterator: prefetched batches of the old
plan are discarded, and worker processes that are persistent (the default with workers)
stay alive, so a regroup costs the time to refill the prefetch queue, not to start
workers. The sampler's position moves only when a step commits, so every sample is
trained on once per epoch whatever the prefetch had read.

**Worker processes start when the loader is made**, and a loader may be made before the
model and ``run.wrap``: a fork shares every page of the trainer with the workers
copy-on-write, so each page the trainer writes afterwards is faulted in and copied once.
Forked after the model, the optimizer, an EMA and a joiner's state from its peer, that
is all of the first step's memory, on the step where the group waits for the new worker
(docs/training-loop.md, "Make the loader before the model"). The batches need the
sampler given to ``wrap``, so the loader is iterated after it.

**The first micro-batch of each round is read in the training process**, while the
workers start on the rest: a worker builds a whole micro-batch alone, so reading one here
takes no longer than a worker's first, and it spares the round's first step the workers'
start (a fork and their set-up: 0.12-0.18 s for two workers of the realistic example
with nothing else running, 0.35 s beside training on two cores), which a worker that
replaces a killed one or joins a running group paid while its peers waited in the
step's all-reduce. Each item is read under its own seed wherever it is read, and the
process's generators get their states back after it, so the batch and the training are
the same. Not with a ``worker_init_fn``: a dataset may need what it sets up in each
worker.

Each step's batch on every rank is real data: where a rank has no sample left in the
epoch's last step (fewer samples than ranks), it gets one *filler* sample whose gradient
the Run's DDP communication hook weighs by zero, so no script has to handle an empty
batch. More generally the hook weighs each rank's gradient by its share of the global
batch (``samples on this rank / global batch``): DDP's plain average when the shares
are equal, and at an epoch's uneven end a rank with fewer samples counts for less.

Items are read under a seed fixed by ``(seed, epoch, index)``
(:mod:`elasticjob_runtime.training.seeds`), so random augmentation is the same whichever
rank, world size or worker reads a sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from elasticjob_runtime.training.seeds import generators_kept, sample_seed, seed_all

if TYPE_CHECKING:
    from elasticjob_runtime.training.step_loop import StepLoop


@dataclass(frozen=True)
class StepBatches:
    """One step on one rank: the dataset indices of each micro-batch, and how many of
    them are real samples (0: the single micro-batch is a filler, weighed by zero)."""

    micro: tuple[tuple[int, ...], ...]
    samples: int


def plan_steps(
    shard: Sequence[int], steps: int, step_size: int, micro_size: int, filler: int
) -> list[StepBatches]:
    """This rank's ``steps`` steps from its ``shard`` (its indices for the rest of the
    epoch, in order): ``step_size`` samples a step, in micro-batches of ``micro_size``;
    a step with no sample left gets the ``filler`` index alone."""
    if step_size < 1 or micro_size < 1:
        raise ValueError(f"step_size and micro_size must be at least 1 ({step_size}, {micro_size})")
    plan = []
    for j in range(steps):
        taken = tuple(shard[j * step_size : (j + 1) * step_size])
        if not taken:
            plan.append(StepBatches(((filler,),), 0))
            continue
        micro = tuple(taken[i : i + micro_size] for i in range(0, len(taken), micro_size))
        plan.append(StepBatches(micro, len(taken)))
    return plan


class SeededItems(Dataset[Any]):
    """``dataset[index]`` read under the seed of ``(seed, epoch, index)``; its keys are
    ``(seed, epoch, index)``, which the round's batch sampler hands out: the seed travels
    with each key because the workers may be forked before the Run knows it (a loader
    made before ``wrap`` in a ``Run(seed=None)`` takes the sampler's)."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __getitem__(self, key: tuple[int, int, int]) -> Any:
        seed, epoch, index = key
        seed_all(sample_seed(seed, epoch, index))
        return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]


def read_here(plan: Sequence[StepBatches], num_workers: int, has_worker_init: bool) -> int:
    """How many of a round's first micro-batches the training process reads itself: the
    first, when there are workers to spare it their start, none without workers (all are
    read here anyway) or with a ``worker_init_fn`` (module docstring)."""
    return 1 if plan and num_workers > 0 and not has_worker_init else 0


def pinned(batch: Any) -> Any:
    """``batch`` with its tensors in pinned memory, as DataLoader's ``pin_memory=True``
    hands out a worker's batch (tensors, and the lists, tuples and dicts holding them)."""
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, Mapping):
        return {key: pinned(value) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(pinned(value) for value in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(pinned(value) for value in batch)
    return batch


class RoundBatches(Sampler[list[tuple[int, int, int]]]):
    """The batch sampler the DataLoader reads: the current round's micro-batches, as
    ``(seed, epoch, index)`` keys. Replaced (``load``) before each reset of the iterator."""

    def __init__(self) -> None:
        self._batches: list[list[tuple[int, int, int]]] = []

    def load(self, seed: int, epoch: int, plan: Sequence[StepBatches], skip: int = 0) -> None:
        """The micro-batches of ``plan`` as keys, less the first ``skip`` of them."""
        keys = [[(seed, epoch, i) for i in micro] for step in plan for micro in step.micro]
        self._batches = keys[skip:]

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        return iter(self._batches)

    def __len__(self) -> int:
        return len(self._batches)


class ElasticLoader:
    """Iterate it inside ``for epoch in run.epochs(n):``; each item is one step's batch
    (a list of ``accumulate`` micro-batches when ``accumulate > 1``), to be trained on in
    one ``with run.step():``. Made by :meth:`elasticjob_runtime.training.run.Run.loader`."""

    def __init__(
        self,
        loop: StepLoop,
        dataset: Dataset[Any],
        batch_size: int,
        *,
        seed: Callable[[], int],
        accumulate: int = 1,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        persistent_workers: bool | None = None,
        prefetch_factor: int | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1 (got {batch_size})")
        if accumulate < 1:
            raise ValueError(f"accumulate must be at least 1 (got {accumulate})")
        self._loop = loop
        self.batch_size = batch_size
        self._seed = seed  # read at each round: the sampler may come after the loader
        self._items = SeededItems(dataset)
        if loop.has_sampler:
            self.check_size()
        self._num_workers = num_workers
        self._has_worker_init = worker_init_fn is not None
        self._pin_memory = pin_memory
        self.accumulate = accumulate
        self._batches = RoundBatches()
        # Workers outlive a regroup only when persistent; a new set per round would cost
        # a fork and the dataset's set-up each time.
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        self.dataloader: DataLoader[Any] = DataLoader(
            self._items,
            batch_sampler=self._batches,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            # its own generator: an iterator's reset must not draw from the training
            # process's RNG (the step seeds would hide it, but a user's own draws not)
            generator=torch.Generator().manual_seed(0),
        )
        if persistent_workers and num_workers > 0:
            # Start the workers now: made before the model, they are forked from a small
            # process, and the trainer's later memory is never copy-on-write (module
            # docstring). An empty plan: they wait for the first round's.
            iter(self.dataloader)

    def check_size(self) -> None:
        """The dataset must be the one the sampler was made for."""
        size = len(self._items)
        if size != self._loop.sampler.num_samples:
            raise ValueError(
                f"the dataset has {size} samples but the sampler given to run.wrap() has "
                f"{self._loop.sampler.num_samples}; make it ElasticSampler(len(dataset), ...)"
            )

    @property
    def step_size(self) -> int:
        """Samples each rank takes per step."""
        return self.batch_size * self.accumulate

    def __iter__(self) -> Iterator[Any]:
        if not self._loop.has_sampler:
            raise RuntimeError(
                "the loader's batches come from the sampler given to run.wrap(...) or "
                "run.shard(...): call one of them before iterating the loader"
            )
        self.check_size()
        return self._loop.rounds_of_steps(self.step_size, self._start_round)

    def _start_round(self, shard: list[int], steps: int) -> Iterator[Any]:
        """The batches of this round's ``steps`` from this rank's ``shard``, in order."""
        plan = plan_steps(shard, steps, self.step_size, self.batch_size, filler=0)
        seed, epoch = self._seed(), self._loop.sampler.epoch
        here = read_here(plan, self._num_workers, self._has_worker_init)
        self._batches.load(seed, epoch, plan, skip=here)
        produced = iter(self.dataloader)  # persistent workers: a reset, not a new set
        first = [self._read(seed, epoch, plan[0].micro[i]) for i in range(here)]
        for step in plan:
            micro = [first.pop(0) if first else next(produced) for _ in step.micro]
            self._loop.rank_samples = step.samples
            yield micro if self.accumulate > 1 else micro[0]

    def _read(self, seed: int, epoch: int, indices: Sequence[int]) -> Any:
        """One micro-batch read in this process, as a worker would have read it."""
        with generators_kept():  # each item seeds them; the training's draws go on
            batch = self.dataloader.collate_fn([self._items[(seed, epoch, i)] for i in indices])
        return pinned(batch) if self._pin_memory else batch
