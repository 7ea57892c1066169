"""The GPT of train_gpt.py sharded with FSDP2, elastic in place: shards move between ranks.

Each transformer block and the root are ``fully_shard``-ed on the mesh the Run gives each
round; AdamW, a warmup + cosine ``LambdaLR``, gradient accumulation, clipping and a
``DataLoader`` with worker processes, as a real FSDP2 script has them. When the world
changes (a join, a departure, a lost worker) the survivors keep their processes and the
shards move to their new owners from memory, or, when a rank took the only copy of its
shard with it, every rank reads the newest DCP checkpoint. docs/training-loop.md
("Sharded models") shows the diff from the plain FSDP2 script; the lines marked
``# elastic`` are the change::

    elasticjob-run --nnodes=1:3 --nproc-per-node=1 --rdzv-endpoint=127.0.0.1:2379 \\
        --rdzv-id=gpt -m elasticjob_examples.train_gpt_fsdp --steps 200

Logs as train_gpt.py does, each regroup with this process's peak memory before it and
after it (what moving the shards cost on top of training). ``--log-state 1`` logs, after
every step, fingerprints of the whole sharded model and optimizer (the same at any world
size) and of the scheduler, so a test compares a faulted run with an unfaulted one
whatever the world size at each step (these are collectives outside the step: for tests
of small models); ``--dump PATH`` saves the whole model at the end, to compare a sharded
run with one process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from elasticjob_runtime import ElasticSampler, Run, StepOutcome  # elastic
from elasticjob_runtime.training.fingerprint import fingerprint, sharded_fingerprint
from elasticjob_runtime.training.run import DEFAULT_COPY_EVERY

# the installed name of examples/ (this file runs as a script or a module of it)
from elasticjob_examples.train_gpt import (  # type: ignore[import-not-found]  # isort: skip
    GPT,
    RESULT_PREFIX,
    Sequences,
    arguments,
    say,
    say_committed,
    say_progress,
    say_samples,
    warmup_cosine,
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """train_gpt.py's flags, and what a comparison with one process needs."""
    p: argparse.ArgumentParser = arguments(__doc__.split("\n", 1)[0])
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping (0: off)")
    p.add_argument("--dump", default="", help="rank 0 saves the whole model there at the end")
    p.add_argument(
        "--shard-group-size",
        type=int,
        default=0,
        help="HSDP: shard over groups of this many ranks, replicate across them (0: FSDP2)",
    )
    p.add_argument(
        "--copy-every",
        type=int,
        default=DEFAULT_COPY_EVERY,
        help="steps between copies of each rank's shards to a peer's memory (0: none)",
    )
    return p.parse_args(argv)


def sharded_builder(args: argparse.Namespace) -> Any:
    """``build(mesh)``: the model sharded block by block, its optimizer and scheduler."""

    def build(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:  # elastic
        model = GPT(args.vocab, args.seq, args.dim, args.layers, args.heads, args.dropout)
        for block in model.blocks.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim: torch.optim.Optimizer
        if args.optimizer == "sgd":
            optim = torch.optim.SGD(model.parameters(), lr=args.lr)
        else:
            optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, warmup_cosine(args.warmup, args.steps))
        return model, optim, {"scheduler": sched}  # elastic

    return build


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    steady_peak = [0.0]  # the peak before the last regroup: training's own, for the log
    torch.set_num_threads(args.threads)
    run = Run(  # elastic
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_interval=args.checkpoint_interval,
        seed=args.seed,
        backend=args.backend,
        on_regroup=lambda run: say(
            f"regrouped at step {run.global_step} ({run.resumed_from}) "
            f"world={run.world_size} rank={run.rank} peak_rss_mb={peak_rss_mb():.0f} "
            f"steady_peak_rss_mb={steady_peak[0]:.0f} t={time.time():.3f}"
        ),
    )
    dataset = Sequences(args.samples, args.seq, args.vocab)
    loader = run.loader(  # elastic: before the model, so its workers fork from a small process
        dataset, args.batch_size, accumulate=args.accumulate, num_workers=args.workers
    )
    sampler = ElasticSampler(len(dataset), seed=args.seed)  # elastic
    model, optim, state = run.shard(  # elastic
        sharded_builder(args),
        sampler,
        copy_every=args.copy_every,
        shard_group_size=args.shard_group_size or None,
    )
    sched = state["scheduler"]  # elastic
    say(
        f"started ({run.resumed_from}) at step {run.global_step} world={run.world_size} "
        f"rank={run.rank} pid={os.getpid()} device={run.device} t={time.time():.3f}"
    )
    loss_fn = nn.CrossEntropyLoss()
    started = time.monotonic()
    total = 0.0
    for epoch in run.epochs(args.epochs, max_steps=args.steps):  # elastic
        for batch in loader:  # elastic
            micro_batches = batch if args.accumulate > 1 else [batch]  # one: not a list
            with run.step() as step:  # elastic
                say_samples(args, run, epoch, micro_batches)
                total = 0.0
                for inputs, targets, _ in run.accumulate(micro_batches):  # elastic
                    inputs, targets = inputs.to(run.device), targets.to(run.device)
                    logits = model(inputs)
                    loss = loss_fn(logits.flatten(0, 1), targets.flatten())
                    (loss / len(micro_batches)).backward()
                    total += float(loss.detach()) / len(micro_batches)
                if args.clip:
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                optim.step()
                optim.zero_grad(set_to_none=True)
                sched.step()
            if not step.committed:
                continue
            steady_peak[0] = peak_rss_mb()
            log_step(args, run, step, epoch, total, model, optim, sched)
            if args.sleep:
                time.sleep(args.sleep)
    whole_model = sharded_fingerprint(model)  # a collective: before the group is gone
    if args.dump:
        dump_whole_model(model, args.dump, run.rank)
    run.finish()  # elastic
    if run.rank == 0:
        result = {
            "steps": run.global_step,
            "samples": run.samples,
            "world_size": run.world_size,
            "loss": round(total, 6),
            "model": whole_model,
            "seconds_this_run": round(time.monotonic() - started, 3),
        }
        say(RESULT_PREFIX + json.dumps(result, sort_keys=True))


def dump_whole_model(model: Any, path: str, rank: int) -> None:
    """Save the whole model at ``path`` (every rank calls it), for a test that compares a
    sharded run with one process, on a small model. Each rank writes its shards through
    DCP and rank 0 joins them into one ``torch.save`` file. A full state dict gathered
    over gloo instead crashed a 2 x 2 HSDP job with SIGSEGV, its shards on a GPU."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    shards = f"{path}.dcp"
    save(get_model_state_dict(model), checkpoint_id=shards)  # collective: all ranks
    if rank == 0:
        dcp_to_torch_save(shards, path)


def log_step(
    args: argparse.Namespace,
    run: Run,
    step: StepOutcome,
    epoch: int,
    loss: float,
    model: Any,
    optim: Any,
    sched: Any,
) -> None:
    now = time.time()
    say_committed(args, run, step, now)
    # collectives of the step's group: not once this rank is in another (a peer died in
    # the checkpoint or the shard copy after the commit), whose new member never ran it
    if args.log_state and not step.regrouped:
        say(
            f"state step={run.global_step} rank={run.rank} world={run.world_size} "
            f"model={sharded_fingerprint(model)} optim={sharded_fingerprint(optim)} "
            f"scheduler={fingerprint(sched)}"
        )
    say_progress(args, run, epoch, loss, sched, now)


if __name__ == "__main__":
    main(sys.argv[1:])
