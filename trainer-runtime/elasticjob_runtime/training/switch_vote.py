"""The agreed switch step: every rank of a round leaves it at the same step boundary.

Each worker hears of the next round from its own agent (:mod:`elasticjob_runtime.launch.channel`),
and the agents do not all hear at the same moment. Were each rank to switch at the first
boundary after its own agent's delivery, a rank that heard before step ``k`` would leave
the old group while a rank that heard during step ``k`` was inside it: that step's
collectives fail, the step is dropped and trained again in the new round. Nothing is
trained twice, but a step's work is lost and the pause grows by a step.

So the ranks vote, inside the step. As a step begins, every rank casts a ballot, 1 when it
knows a newer round exists (its agent delivered one, or its node handed its place over
and is leaving) and 0 otherwise. The ballots are summed in the step's own gradient
all-reduce (:mod:`elasticjob_runtime.training.grad_allreduce`), one more element on the
first bucket DDP reduces that is dense and at most :data:`CARRY_BYTES` (DDP reduces its
buckets in the same order on every rank, so every rank picks the same one), so the vote
costs no collective of its own; a step in which no bucket carried it sums the ballots in
an all-reduce of their own. The sum is read before the optimizer's update (an optimizer
step pre-hook), or at the step's end when no optimizer ran. Every rank reads the same
sum for the same step and, when it is above 0, all leave the round at that step's end:
a rank whose agent has not delivered yet waits for it there, with its step committed,
instead of in a broken step.

A rank alone in its round, and a worker that cannot regroup in place, cast no ballot.
With NCCL the sum lives on the GPU, and reading it waits for the GPU's stream up to the
end of the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

# The largest bucket a ballot rides on: appending copies the bucket twice (there and
# back), cheap for DDP's own first bucket (1 MiB), not for a bucket that DDP's rebuild
# gave to a large layer alone (an LM head: tens of MB). Sparse buckets cannot carry one.
CARRY_BYTES = 1 << 20


def ballot(knows_newer_round: bool, handed_over: bool) -> int:
    """What a rank votes as a step begins: 1 when the round must end after this step."""
    return 1 if knows_newer_round or handed_over else 0


def switch_due(agreed: bool, world_size: int, knows_newer_round: bool) -> bool:
    """Does this rank leave its round at this step boundary? By the vote, except a rank
    alone in its round: nobody can be caught mid-step, so it goes as soon as it knows."""
    return agreed or (world_size == 1 and knows_newer_round)


def can_carry(buffer: torch.Tensor) -> bool:
    """Can a ballot ride on this gradient bucket (the same answer on every rank)?"""
    return not buffer.is_sparse and buffer.numel() * buffer.element_size() <= CARRY_BYTES


class SwitchVote:
    """One step's vote at a time: cast as the step begins, carried by the step's gradient
    all-reduce (or sent alone), counted once before the step ends."""

    def __init__(self) -> None:
        # Has this rank been told to stop (SIGTERM)? Asked when the vote is counted. Only a
        # model that every rank saves together (sharded) needs its ranks to agree on the
        # step they stop at: the Run sets it for one, and its ballots are never carried.
        self.stopping: Callable[[], bool] | None = None
        self._ballot: int | None = None  # cast this step, not yet counted
        self._carried: torch.Tensor | None = None  # an all-reduce payload ending in the sum
        self._cast_in = -1  # the generation (round) of the vote under way
        self._agreed_in = -1  # the generation whose last counted vote said "switch"
        self._stop_in = -1  # ... and whose last counted vote said "stop"

    def cast(self, vote: int, generation: int) -> None:
        """This rank's ``vote`` in round ``generation``, for the step beginning now."""
        self._ballot, self._carried, self._cast_in = vote, None, generation

    def carry(self, buffer: torch.Tensor) -> torch.Tensor:
        """What the step's all-reduce sums instead of the flat gradient ``buffer``: the
        buffer with the ballot appended, for the first bucket of the step that can carry
        it while a ballot is cast (else the buffer itself)."""
        if self._ballot is None or self._carried is not None or not can_carry(buffer):
            return buffer
        if self.stopping is not None:  # a stop is read when counted, after the buffer went
            return buffer
        payload = torch.cat([buffer, buffer.new_full((1,), float(self._ballot))])
        self._carried = payload
        return payload

    def count(self, device: torch.device) -> None:
        """Read the sum of the vote under way, if any; an all-reduce of its own when no
        gradient all-reduce carried it. Raises what a broken group raised. Called from the
        optimizer's pre-hook and again at the step's end (then a no-op)."""
        if self._ballot is None:
            return
        mine, carried = self._ballot, self._carried
        self._ballot, self._carried = None, None
        if carried is not None:  # DDP waited for its all-reduce before backward returned
            total, stops = float(carried[-1].item()), 0
        else:
            stop = int(self.stopping is not None and self.stopping())
            alone = torch.tensor([mine, stop], dtype=torch.int64, device=device)
            dist.all_reduce(alone)
            total, stops = float(alone[0].item()), int(alone[1].item())
        if total > 0:
            self._agreed_in = self._cast_in
        self._stop_in = self._cast_in if stops > 0 else -1

    def discard(self) -> None:
        """The group broke in the step: its vote will never be counted."""
        self._ballot, self._carried = None, None

    def agreed(self, generation: int) -> bool:
        """Did the ranks of round ``generation`` agree to leave it at this boundary?"""
        return self._agreed_in == generation

    def stop_agreed(self, generation: int) -> bool:
        """Did a rank of round ``generation`` say, in the last vote counted, that it was
        told to stop? Then every rank saves this step together (the Run)."""
        return self._stop_in == generation
