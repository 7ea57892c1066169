"""Randomness that recovery can reproduce: every draw is a function of where it happens.

A worker that dies takes its random generators' states with it, and a step that is
dropped and retried has already drawn from them. Saving every rank's generators at every
step would cost a collective per step; instead the Run seeds them at the start of each
step from ``(seed, step, rank)``, and the loader seeds them before each sample from
``(seed, epoch, index)``. So dropout in step 31 on rank 1 draws the same numbers whether
that step runs once, is retried after a peer died, or runs in a process that was
started for it, and a sample's augmentation is the same whatever rank, world size or
loader worker reads it. Nothing needs to be checkpointed or sent to a joiner: the state
of every generator is known from the step counter, which already is.

The generators: torch's CPU generator, every initialized CUDA device's, Python's
``random``, and numpy's global one when numpy is already imported (never imported here).
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Final

import torch

_MASK64: Final = (1 << 64) - 1
# Distinct streams for steps and samples: a step seed never equals a sample seed.
STEP_STREAM: Final = 0x5354_4550  # "STEP"
SAMPLE_STREAM: Final = 0x5341_4D50  # "SAMP"
FETCH_STREAM: Final = 0x4645_5443  # "FETC"


def mix(*parts: int) -> int:
    """A 64-bit seed from integers (splitmix64 over each part): nearby inputs give
    unrelated seeds, and the result is the same in every process and Python version."""
    state = 0x9E37_79B9_7F4A_7C15
    for part in parts:
        state = (state ^ (part & _MASK64)) & _MASK64
        state = (state + 0x9E37_79B9_7F4A_7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK64
        state = z ^ (z >> 31)
    return state


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of global step ``step`` (1-based, the step being taken) on ``rank``."""
    return mix(STEP_STREAM, seed, step, rank)


def fetch_seed(seed: int, step: int, rank: int) -> int:
    """The seed under which ``run.batches`` fetches the batch of ``step`` on ``rank``."""
    return mix(FETCH_STREAM, seed, step, rank)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed under which dataset item ``index`` of ``epoch`` is read."""
    return mix(SAMPLE_STREAM, seed, epoch, index)


def seed_all(value: int) -> None:
    """Seed torch (CPU and initialized CUDA devices), ``random`` and numpy if loaded.

    ``torch.manual_seed`` costs about 70 us (it visits every accelerator backend); the
    CPU generator's own ``manual_seed`` costs 1 us, and CUDA is seeded only where a
    context already exists, so a step pays a few microseconds."""
    value &= _MASK64
    torch.default_generator.manual_seed(value)
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.manual_seed_all(value)
    random.seed(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(value & 0xFFFF_FFFF)  # numpy's legacy seed is 32 bits


@contextlib.contextmanager
def generators_kept() -> Iterator[None]:
    """Run a block that seeds the generators (a sample read in the training process)
    and give them back their states after it: the training's own draws, which a Run
    with ``seed=None`` does not re-seed, go on where they were."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    python = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    devices = list(range(torch.cuda.device_count())) if cuda else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python)
        if numpy is not None and numpy_state is not None:
            numpy.random.set_state(numpy_state)
