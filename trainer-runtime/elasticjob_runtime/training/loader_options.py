"""What ``run.loader(dataset, batch_size, **options)`` accepts, and one line for what not.

A script converted from a plain ``DataLoader`` brings that loader's keywords along. The
ones the Run owns (which samples, in which order, under which seed) raised Python's own
``TypeError`` ("got multiple values for keyword argument 'seed'", or "unexpected keyword
argument 'shuffle'"), which says nothing about what to do; each now gets a line that
names what decides it instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

ACCEPTED: Final = (
    "accumulate",
    "num_workers",
    "collate_fn",
    "pin_memory",
    "persistent_workers",
    "prefetch_factor",
    "worker_init_fn",
    "multiprocessing_context",
)
OWNED: Final = {
    "seed": "each sample is read under a seed from Run(seed=...), the epoch and its index",
    "shuffle": "the ElasticSampler given to run.wrap/run.shard orders the samples "
    "(ElasticSampler(len(dataset), shuffle=...))",
    "sampler": "the Run gives each rank its samples from the ElasticSampler given to "
    "run.wrap/run.shard",
    "batch_sampler": "the Run makes each step's batches itself",
    "drop_last": "every sample is trained once per epoch; the epoch's last step is smaller",
    "generator": "each sample is read under a seed from Run(seed=...), the epoch and its index",
    "timeout": "not supported here",
    "in_order": "batches always come in the Run's order",
}


def refused_option(names: Iterable[str]) -> str | None:
    """The line for the first option ``run.loader`` does not take, or None."""
    for name in names:
        if name in ACCEPTED:
            continue
        why = OWNED.get(name)
        if why is not None:
            return f"run.loader() takes no {name}=: {why}"
        return (
            f"run.loader() takes no {name}=; its options are {', '.join(ACCEPTED)} "
            "(docs/training-loop.md)"
        )
    return None
