"""The step rule: each batch goes through one ``with run.step():``, which commits or drops.

:class:`StepLoop` plans a round's steps (every rank the same number, from the sampler's
committed position), hands out one batch per step, and ends each step: committed when
the block ends, dropped when a collective in it fails because the group broke (then no
gradient is left behind and the worker regroups), and refused (:class:`StepBrokeAfterUpdate`)
when the group broke after the optimizer's update. A regroup, or a newer round the ranks
agreed on in a step (switch_vote.py), starts a new round's plan from where the group is.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from elasticjob_runtime.training.agreement import Agreement
from elasticjob_runtime.training.replication import Replication
from elasticjob_runtime.training.sampler import ElasticSampler
from elasticjob_runtime.training.seeds import fetch_seed, seed_all, step_seed
from elasticjob_runtime.training.state import TrainingState
from elasticjob_runtime.training.switch_vote import SwitchVote, ballot, switch_due
from elasticjob_runtime.training.worker_rounds import WorkerRounds

log = logging.getLogger(__name__)

Batch = TypeVar("Batch")


def steps_left(remaining: int, world_size: int, batch_size: int) -> int:
    """Optimizer steps until the epoch's end: the same on every rank."""
    return -(-remaining // (world_size * batch_size))


class StepBrokeAfterUpdate(RuntimeError):
    """The group broke after this step's optimizer update: the worker cannot recover in
    place (its agent restarts it)."""


def broke_after_update(step: int, exc: BaseException) -> StepBrokeAfterUpdate:
    """A collective after optimizer.step() failed: the update ran, the rest of the step
    (the scaler's update, the scheduler, the EMA) did not. Dropping the step would apply
    the update twice, keeping it would leave it half done: neither is the unfaulted run.
    The process restarts instead, and takes the state from a peer that never got so far,
    or a checkpoint."""
    return StepBrokeAfterUpdate(
        f"step {step} broke after the optimizer's update (a collective after "
        f"optimizer.step() failed: {str(exc).splitlines()[0]}); this worker restarts and "
        "resumes from a peer or the last checkpoint. Move collectives of your own before "
        "optimizer.step() to recover in place"
    )


@dataclass
class StepOutcome:
    """What ``with run.step() as outcome:`` tells the code after the block: whether the
    step counts (``committed``), the round it ran in (``round_id``), its number (``step``),
    and whether this rank has moved to another group since it began (``regrouped``: the
    step was dropped, or it committed and the group then broke in its checkpoint or shard
    copy). A collective of your own after the block runs only where ``regrouped`` is
    False: the new group's new member never ran the step, and would never join it."""

    committed: bool = False  # False: the step was dropped (the group broke in it)
    round_id: str = ""  # the round the step ran in (Run.round_id as it began)
    step: int = 0  # its number (Run.global_step once it commits, unless a regroup rolls back)
    # True: this rank is in another group than the step's (it regrouped as the step was
    # dropped, or after its commit, when the checkpoint or the shard copy found the group
    # broken): a collective of the step's group after the block would meet a new group
    # that never ran the step, so one of your own runs only when this is False
    regrouped: bool = False


class StepLoop:
    """Steps, rounds of steps, and what ends each step."""

    def __init__(
        self,
        state: TrainingState,
        rounds: WorkerRounds,
        agreement: Agreement,
        seed: int | None,
        regroup: Callable[[bool], None],
        committed: Callable[[], None],
        timings: dict[str, float],
        resynced: Callable[[float], None] = lambda began: None,
    ) -> None:
        self._state, self._rounds, self._agreement = state, rounds, agreement
        self.seed = seed
        self._regroup = regroup  # regroup(failed): the Run leaves this round for the next
        self._committed = committed  # after a commit: checkpoint and progress
        self._resynced = resynced  # resynced(began): a divergence's copy is done (goodput)
        self._timings = timings
        self.plan = 0  # bumped when the state changed under a round's plan (a resync)
        self.global_batch = 0  # samples the whole group takes in the current step
        self.batch_size = 1
        self.max_steps: int | None = None
        self.rank_samples: int | None = None  # this rank's real samples in this step
        self._updated = False  # an optimizer stepped in the step under way
        self.vote = SwitchVote()  # whether the round ends after the step under way
        self._phase = "idle"  # idle -> fetched (a batch is out) -> running (in step())
        self.replica: Replication | None = None  # the model's layout, once wrapped

    @property
    def reached_max_steps(self) -> bool:
        return self.max_steps is not None and self._state.step >= self.max_steps

    @property
    def has_sampler(self) -> bool:
        """Was the sampler given (``wrap`` or ``shard``)?"""
        return self._state.sampler is not None

    @property
    def sampler(self) -> ElasticSampler:
        if self._state.sampler is None:
            raise RuntimeError("call run.wrap(model, optimizer, sampler) first")
        return self._state.sampler

    # what the gradient all-reduce reads to weigh the gradients (grad_allreduce.Shares)

    @property
    def world_size(self) -> int:
        return self._rounds.world_size

    @property
    def weighted_samples(self) -> int | None:
        """This rank's samples in the step."""
        return self.rank_samples

    def epochs(self, count: int, max_steps: int | None) -> Iterator[int]:
        """``Run.epochs``: the restored epoch up to ``count`` (or until ``max_steps``)."""
        self.max_steps = max_steps
        sampler = self.sampler
        while sampler.epoch < count and not self.reached_max_steps:
            epoch = sampler.epoch
            yield epoch
            if sampler.epoch == epoch and sampler.remaining == 0:
                sampler.set_epoch(epoch + 1)

    def batches(self, fetch: Callable[[list[int]], Batch], batch_size: int) -> Iterator[Batch]:
        """``Run.batches``: ``fetch(indices)`` for each step left, in the training thread."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1 (got {batch_size})")

        def fetch_round(shard: list[int], steps: int) -> Iterator[Batch]:
            for j in range(steps):
                indices = shard[j * batch_size : (j + 1) * batch_size]
                self.rank_samples = len(indices)
                if self.seed is not None:  # fetch runs before its step: seeded on its own
                    seed_all(fetch_seed(self.seed, self._state.step + 1, self._rounds.rank))
                yield fetch(indices)

        return self.rounds_of_steps(batch_size, fetch_round)

    def note_update(self, *_: Any) -> None:
        """An optimizer's step-post hook: this step's update has run."""
        self._updated = True

    def count_vote(self, *_: Any) -> None:
        """An optimizer's step-pre hook: the switch vote is counted before the update, so
        a group that broke while voting drops the step instead of breaking it."""
        self.vote.count(self._rounds.device)

    def _cast_vote(self) -> None:
        """As a step begins: does this rank know that the round must end after it?"""
        r = self._rounds
        if r.world_size == 1 or (r.channel is None and self.vote.stopping is None):
            return  # nobody to agree with, or nothing to agree on
        self.vote.cast(ballot(r.switch_pending(), r.handed_over()), r.generation)

    def stop_agreed(self) -> bool:
        """Is the step just committed the one the ranks stop at, each told to stop or not,
        so that they save it together (a sharded model)? A rank alone decides alone."""
        r, stopping = self._rounds, self.vote.stopping
        if r.world_size == 1:
            return stopping is not None and stopping()
        return self.vote.stop_agreed(r.generation)

    def _switch_due(self) -> bool:
        """Do the ranks leave this round at this boundary (switch_vote.py)?"""
        r = self._rounds
        alone = r.world_size == 1  # only then does the rule read what this rank knows
        return switch_due(
            self.vote.agreed(r.generation), r.world_size, alone and r.switch_pending()
        )

    def rounds_of_steps(
        self, step_size: int, start_round: Callable[[list[int], int], Iterator[Batch]]
    ) -> Iterator[Batch]:
        """Each step's batch until the epoch ends, round after round: ``start_round(shard,
        steps)`` yields the round's batches from this rank's ``shard`` (its indices from
        the committed position on); a regroup starts a new round from where the group is."""
        self.batch_size = step_size
        sampler, rounds = self.sampler, self._rounds
        epoch = sampler.epoch

        def more() -> bool:
            return sampler.epoch == epoch and sampler.remaining > 0 and not self.reached_max_steps

        while more():
            if self._switch_due():
                self._regroup(False)
            generation, plan = rounds.generation, self.plan
            steps = steps_left(sampler.remaining, rounds.world_size, step_size)
            started = time.monotonic()
            produced = start_round(list(sampler), steps)  # this round's shard
            first = True
            while generation == rounds.generation and plan == self.plan and more():
                if self._switch_due():
                    break  # every rank agreed in the last step: switch here, between steps
                self.global_batch = min(rounds.world_size * step_size, sampler.remaining)
                batch = next(produced)
                if first:  # a round's plan, and the loader's refill after a reset
                    self._timings["first_batch"] = time.monotonic() - started
                    first = False
                self._phase = "fetched"
                yield batch
                if self._phase == "fetched":
                    raise RuntimeError(
                        "each batch from run.batches() or run.loader() needs one "
                        "`with run.step():` around its training step"
                    )

    def forward_allowed(self) -> None:
        """Before a forward of the wrapped model: inside a step whose group this worker
        has given up, raise (a ``DistError``: the step is dropped and the worker
        regroups) instead of computing the rest of the step; outside a step, nothing."""
        if self._phase == "running":
            self._rounds.leave_abandoned_step()

    @contextlib.contextmanager
    def step(self) -> Iterator[StepOutcome]:
        """One optimizer step (``Run.step``)."""
        if self._phase != "fetched":
            raise RuntimeError(
                "`with run.step():` goes once around each batch of run.batches() or run.loader()"
            )
        self._phase, self._updated = "running", False
        next_step = self._state.step + 1
        if self.seed is not None:
            seed_all(step_seed(self.seed, next_step, self._rounds.rank))
        outcome = StepOutcome(round_id=self._rounds.round_id, step=next_step)
        self._cast_vote()
        try:
            yield outcome
            self.vote.count(self._rounds.device)  # when no optimizer's pre-hook counted it
        except Exception as exc:
            self._phase = "idle"
            self.vote.discard()
            if not self._rounds.group_broke(exc):
                raise
            outcome.regrouped = True
            if self._rounds.handed_over():
                self._regroup(True)  # leaves: the peers went on without this node
            if self._updated:
                raise broke_after_update(next_step, exc) from exc
            log.warning("step %d dropped: %s", next_step, str(exc).splitlines()[0])
            self._state.clear_gradients()
            self._regroup(True)
            return
        self._phase = "idle"
        # Committed before the commit's side effects: a SIGTERM saves this step there and
        # exits 143 from inside the block's end, and the script may still record it.
        outcome.committed = True
        # after the commit, collectives the step's group makes together: the interval's
        # checkpoint (a sharded save plans together), what the replication keeps (shard
        # copies), then the agreement check when one is due; a group that broke in one
        # regroups, and the new group checks at its own first step
        kept = self._commit() and self._standing("what the replication keeps", self._keep)
        outcome.regrouped = not (kept and self._check_due())

    def _commit(self) -> bool:
        """Count the step, then its checkpoint and progress; False when the group broke in
        the checkpoint's collectives (a peer died as the ranks planned a sharded save) and
        this rank regrouped: the step stands, the save never commits."""
        st = self._state
        st.step += 1
        st.samples += self.global_batch
        self.sampler.advance(self._rounds.world_size * self.batch_size)
        return self._standing("the checkpoint", self._committed)

    def _standing(self, what: str, collective: Callable[[], None]) -> bool:
        """Run a collective after a commit; False when the group broke in it and this
        rank regrouped (the step stands: peers without it get it)."""
        try:
            collective()
        except Exception as exc:
            if not self._rounds.group_broke(exc):
                raise
            log.warning("%s after step %d broke: %s", what, self._state.step, exc)
            self._regroup(True)
            return False
        return True

    def _keep(self) -> None:
        assert self.replica is not None, "a step commits only once the model is wrapped"
        self.replica.committed(self._state.step, self._rounds, self._switch_due())

    def _check_due(self) -> bool:
        """The agreement check when one is due; False when the group broke in it."""
        when = self._agreement.due(self._state.step)
        return when is None or self._standing("agreement check", lambda: self.check(when))

    def check(self, when: str) -> None:
        """Compare every rank's state now (agreement.py); a resync plans the round anew."""
        if self.replica is None:
            raise RuntimeError("call run.wrap(...) or run.shard(...) first")
        began = time.time()
        if self._agreement.check(when, self._state.step, self.replica, self._rounds):
            self.plan += 1  # the sampler's position may have moved
            self._resynced(began)
