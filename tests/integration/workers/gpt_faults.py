"""examples/train_gpt.py with faults at exact steps, so a faulted run and an unfaulted run
can have the same world history and be compared step by step (``GPT_SCRIPT=train_gpt_fsdp``:
its FSDP2 form, examples/train_gpt_fsdp.py).

After step N is committed and the script has logged it (environment variables, all
optional):

* ``CRASH_AT_STEP`` / ``CRASH_RANK``: that rank's worker SIGKILLs itself (first attempt,
  never regrouped: a survivor that rolled back to a checkpoint trains step N again);
  ``CRASH_IN_STEP``: the same in the middle of that step, at its last micro-batch (its
  peers then hold the first micro-batches' gradients when the step fails);
  ``CRASH_IN_SAVE_AT_STEP``: the same as that step's checkpoint begins, after its
  commit (a sharded save plans together: its peers' planning collective fails, and they
  regroup with the step committed);
* ``HOLD_AT_STEP``: after step N - 1 every worker waits until its agent has a new round
  for it (a node that the test starts once it sees ``held before step N`` joins); each
  then votes in step N to switch (training/switch_vote.py), so the world changes after
  exactly step N in every run;
* ``LOSE_NODE_AT_STEP`` / ``LOSE_NODE_RANK``: that rank SIGKILLs its agent and itself
  (a node lost at once, as when a VM dies);
* ``LEAVE_AT_STEP`` / ``LEAVE_RANK``: after step N - 1 that rank SIGTERMs its agent (a
  pod deleted, a drain): the node announces its departure; every worker then holds
  still until its agent has a new round for it, or, on the leaving node, has handed
  over; all train step N and vote in it to switch, so the world changes after exactly
  step N;
* ``COLLECTIVE_AFTER_UPDATE``: every rank all-reduces a tensor right after each
  optimizer update, inside the step (a script logging an all-reduced value);
  ``CRASH_AFTER_UPDATE_IN_STEP`` / ``CRASH_RANK``: that rank dies right after its update
  in that step (first attempt), so its peers' update ran and their collective fails;
* ``STOP_JOB_AT_STEP``: every worker SIGTERMs its agent (the whole job stopped: deleted,
  evicted); the agents stop their workers, which save their last step and exit;
* ``STOP_AT_STEP``: every worker saves that step and exits 0 (an unfaulted end of one
  world size: a test resumes the checkpoint at another, the reference for a lost node);
* ``TAMPER_AT_STEP`` / ``TAMPER_RANK``: that rank changes its shard of the first
  parameter (train_gpt_fsdp: an HSDP replica that no longer matches its peers);
* ``UNREGISTERED``: names of ``state=`` entries that ``run.wrap`` does not get (the
  script forgets to register them); ``ON_DIVERGENCE``: the Run's ``on_divergence``;
  ``CHECK_EVERY``: its ``check_every``.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from elasticjob_runtime import Run
from elasticjob_runtime.checkpoints.sharded import ShardedCheckpoints


def _at(name: str) -> int:
    return int(os.environ.get(name, "-1"))


def main() -> None:
    train_gpt = importlib.import_module(
        f"elasticjob_examples.{os.environ.get('GPT_SCRIPT', 'train_gpt')}"
    )
    log_step, wrap, accumulate = train_gpt.log_step, Run.wrap, Run.accumulate
    init, sharded_save = Run.__init__, ShardedCheckpoints.save
    runs: list[Run] = []  # this process's Run, once made
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    dropped = {n for n in os.environ.get("UNREGISTERED", "").split(",") if n}

    def faulty_log_step(args: Any, run: Run, *rest: Any) -> None:
        """The step is committed and logged (its samples too): now the fault."""
        log_step(args, run, *rest)
        step, rank = run.global_step, str(run.rank)
        once = first_attempt and run.regroups == 0
        if step == _at("CRASH_AT_STEP") and once and rank == os.environ["CRASH_RANK"]:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == _at("LOSE_NODE_AT_STEP") and rank == os.environ["LOSE_NODE_RANK"]:
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if step == _at("TAMPER_AT_STEP") and rank == os.environ["TAMPER_RANK"]:
            model = rest[3]  # train_gpt_fsdp.log_step(args, run, step, epoch, loss, model..)
            with torch.no_grad():
                next(iter(model.parameters())).to_local().add_(1e-3)
        if step == _at("STOP_JOB_AT_STEP") and first_attempt:  # every agent told to stop
            os.kill(os.getppid(), signal.SIGTERM)
        if step == _at("STOP_AT_STEP"):
            run.save(wait=True)
            print(f"stopped at step {step} rank={run.rank}", flush=True)
            os._exit(0)
        if step == _at("LEAVE_AT_STEP") - 1:
            leaving = rank == os.environ["LEAVE_RANK"]
            if leaving:
                os.kill(os.getppid(), signal.SIGTERM)
            print(f"held before step {step + 1} rank={run.rank}", flush=True)
            rounds, deadline = run._rounds, time.monotonic() + 60
            while time.monotonic() < deadline and not (
                rounds.handed_over() if leaving else rounds.switch_pending()
            ):
                time.sleep(0.02)
        if step == _at("HOLD_AT_STEP") - 1 and run.world_size == int(os.environ["HOLD_WORLD"]):
            print(f"held before step {step + 1} rank={run.rank}", flush=True)
            deadline = time.monotonic() + 240
            while not run._rounds.switch_pending() and time.monotonic() < deadline:
                time.sleep(0.05)

    def faulty_accumulate(self: Run, micro_batches: Any) -> Any:
        crash = self.global_step + 1 == _at("CRASH_IN_STEP") and first_attempt
        for i, micro in enumerate(accumulate(self, micro_batches)):
            last = i == len(micro_batches) - 1
            if crash and last and str(self.rank) == os.environ["CRASH_RANK"]:
                os.kill(os.getpid(), signal.SIGKILL)
            yield micro

    def crashing_save(self: ShardedCheckpoints, step: int, *args: Any, **kw: Any) -> None:
        once = first_attempt and runs[0].regroups == 0
        rank = str(runs[0].rank)
        if step == _at("CRASH_IN_SAVE_AT_STEP") and once and rank == os.environ["CRASH_RANK"]:
            os.kill(os.getpid(), signal.SIGKILL)
        sharded_save(self, step, *args, **kw)

    def forgetful_wrap(self: Run, *args: Any, state: Any = None, **kw: Any) -> Any:
        kept = {k: v for k, v in (state or {}).items() if k not in dropped}
        wrapped = wrap(self, *args, state=kept, **kw)
        if os.environ.get("COLLECTIVE_AFTER_UPDATE"):
            run, optim = self, args[1]

            def after_update(*_: Any) -> None:  # after the Run's own hook: it saw the update
                crash = run.global_step + 1 == _at("CRASH_AFTER_UPDATE_IN_STEP")
                if crash and first_attempt and str(run.rank) == os.environ["CRASH_RANK"]:
                    os.kill(os.getpid(), signal.SIGKILL)
                dist.all_reduce(torch.zeros(1))

            optim.register_step_post_hook(after_update)
        return wrapped

    train_gpt.log_step = faulty_log_step
    Run.accumulate = faulty_accumulate  # type: ignore[method-assign]
    ShardedCheckpoints.save = crashing_save  # type: ignore[method-assign]

    def configured_init(self: Run, **kw: Any) -> None:
        check_every = int(os.environ.get("CHECK_EVERY", "100"))
        on_divergence = os.environ.get("ON_DIVERGENCE", "stop")
        init(self, **kw, on_divergence=on_divergence, check_every=check_every)
        runs.append(self)

    Run.wrap = forgetful_wrap  # type: ignore[method-assign]
    Run.__init__ = configured_init  # type: ignore[method-assign]
    train_gpt.main(sys.argv[1:])


if __name__ == "__main__":
    main()
