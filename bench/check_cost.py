"""Scenario ``check-cost``: what the Run's per-step bookkeeping costs a training step.

Every ``check_every`` steps (Run's default: 100) the ranks compare fingerprints of
model, optimizer, sampler, counters and registered state (``Run._check_agreement``: one
pass over every tensor, then an all-gather of one int64 per object), and every step the
Run seeds the random generators (``seeds.seed_all``). Timing a whole job with the check
on and off cannot resolve 1 % on two busy cores, so each is timed directly, in the
process that pays it: two processes (``multiprocessing``, spawn) form a gloo group on
loopback, build a script's model and optimizer as the script does under an
``Run`` (``in_place=False``: no agent), train ``steps`` steps after a warm-up
(``check_every=0``, so no check lands in them), then call ``_check_agreement`` ``calls``
times, and ``seed_all`` 1000 times. The switch vote (training/switch_vote.py: a ballot
every step under ``elasticjob-run`` casts as it begins, carried as one more element of
the step's gradient all-reduce and counted before the optimizer's update) is timed in
the steps themselves: the timed steps alternate, ten at a time, between steps that vote
(a ballot cast as the step begins; the Run's own hooks carry and count it) and steps
that do not, and the figure is the difference of the two medians. The vote sent in an
all-reduce of its own (a step in which DDP reduced nothing), cast and counted back to
back, is in the note.

Cases: ``train_regression`` (examples/train_regression.py's ``make_model``, Adam, batch
32 per rank, as the bench runs it) and ``train_gpt`` (examples/train_gpt.py's model,
AdamW, LambdaLR, GradScaler and EMA registered with the Run, ``run.loader`` with 2
micro-batches of 8 over pre-built sequences, ``num_workers=0``: the figure's denominator
is the training step, not the data). Step and check times are medians over the calls (two
cores shared with other work: the median is what a step pays, outliers are the
neighbours); the cost per step is ``check / check_every / step``.
"""

from __future__ import annotations

import importlib
import inspect
import multiprocessing
import queue
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.ports import free_port
from bench.report import Figure
from bench.spawned_ranks import as_rank, stop_spawned

SCENARIO = "check-cost"
CASES = ("train_regression", "train_gpt")
TARGET = 1.0  # percent of a step
SEED_CALLS = 1000
# (warm-up steps, timed steps, timed checks): the regression step is milliseconds, GPT's
# a few hundred
SIZES = {"train_regression": (20, 300, 300), "train_gpt": (5, 30, 30)}


# Sample's times, each a median (seed: a mean) in seconds
TIMES = ("step", "voted_step", "check", "fingerprint", "gather", "seed", "vote")


@dataclass
class Sample:
    """One repetition of one case, rank 0's view (rank 1's numbers are in ``peer``)."""

    case: str
    check_every: int
    step: float  # median seconds of a training step under the Run
    check: float  # median seconds of one Run._check_agreement
    fingerprint: float  # of that, median seconds fingerprinting (no collective)
    gather: float  # median seconds of the all-gather alone
    seed: float  # mean seconds of one seed_all(step_seed(...))
    voted_step: float  # median seconds of a training step that also voted
    vote: float  # median seconds of one switch vote in an all-reduce of its own
    objects: int  # fingerprints per check
    peer: dict[str, float] | None = None


def per_step(cost: float, every: int, step: float) -> float:
    """Percent of a step that a cost paid once every ``every`` steps takes."""
    if every < 1 or step <= 0:
        raise ValueError(f"need every >= 1 and step > 0 (got {every}, {step})")
    return 100.0 * cost / every / step


def default_check_every() -> int:
    """Run's own default, so the figure follows the runtime."""
    from elasticjob_runtime import Run

    return int(inspect.signature(Run).parameters["check_every"].default)


# ---------------------------------------------------------------- in each process


def _example(name: str) -> Any:
    """examples/<name>.py by its installed name (mypy does not see that package)."""
    return importlib.import_module(f"elasticjob_examples.{name}")


def _build(case: str, run: Any) -> tuple[Any, Any]:
    """(the batches of one epoch, the step body) of ``case`` under ``run``."""
    import torch
    from torch import nn

    from elasticjob_runtime.training.sampler import ElasticSampler

    if case == "train_regression":
        reg = _example("train_regression")

        samples, batch = 8192, 32
        x, y = reg.make_data(samples, 0)
        model = reg.make_model(0)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        ddp = run.wrap(model, optim, ElasticSampler(samples, seed=0))

        def regression_step(idx: torch.Tensor) -> None:
            xb, yb = x[idx.long()], y[idx.long()]
            sse = ((ddp(xb) - yb) ** 2).sum()
            optim.zero_grad(set_to_none=True)
            (sse * (run.world_size / run.global_batch)).backward()
            optim.step()

        return lambda: run.batches(torch.tensor, batch), regression_step

    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    from torch.utils.data import TensorDataset

    gpt = _example("train_gpt")
    args = gpt.parse_args([])
    bf16 = gpt.use_bf16(args.autocast, torch.device("cpu"))  # once: it reads /proc/cpuinfo
    model = gpt.GPT(args.vocab, args.seq, args.dim, args.layers, args.heads)
    optim_w = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim_w, gpt.warmup_cosine(args.warmup, 10**6))
    scaler = torch.amp.GradScaler("cpu")
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))  # type: ignore[no-untyped-call]
    source = gpt.Sequences(args.samples, args.seq, args.vocab)
    items = [source[i] for i in range(args.samples)]
    data = TensorDataset(
        torch.stack([i[0] for i in items]),
        torch.stack([i[1] for i in items]),
        torch.tensor([i[2] for i in items]),
    )
    ddp_gpt = run.wrap(
        model,
        optim_w,
        ElasticSampler(len(data), seed=0),
        state={"scheduler": sched, "scaler": scaler, "ema": ema},
    )
    loader = run.loader(data, args.batch_size, accumulate=args.accumulate, num_workers=0)
    loss_fn = nn.CrossEntropyLoss()

    def gpt_step(micro_batches: Any) -> None:
        for inputs, targets, _ in run.accumulate(micro_batches):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = ddp_gpt(inputs)
                loss = loss_fn(logits.float().flatten(0, 1), targets.flatten())
            scaler.scale(loss / len(micro_batches)).backward()
        scaler.unscale_(optim_w)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optim_w)
        scaler.update()
        optim_w.zero_grad(set_to_none=True)
        sched.step()
        ema.update_parameters(model)

    return lambda: loader, gpt_step


def _worker(rank: int, port: int, case: str, directory: str, results: Any) -> None:
    """One rank: train, then time the check and the seeding; put rank 0's figures."""
    as_rank(rank, 2, port)
    import torch
    import torch.distributed as dist

    from elasticjob_runtime import Run
    from elasticjob_runtime.training.agreement import gather_rows
    from elasticjob_runtime.training.fingerprint import fingerprint
    from elasticjob_runtime.training.seeds import seed_all, step_seed
    from elasticjob_runtime.training.switch_vote import SwitchVote

    torch.set_num_threads(1)
    warmup, steps, calls = SIZES[case]
    run = Run(
        checkpoint_dir=Path(directory) / f"rank{rank}",
        checkpoint_interval=10**9,  # no save among the timed steps
        in_place=False,
        seed=0,
        check_every=0,  # no check among the timed steps
    )
    batches, body = _build(case, run)
    device = torch.device("cpu")
    vote = run._loop.vote  # under elasticjob-run the step casts it; here in_place=False
    times: list[float] = []
    voted: list[float] = []
    done = False
    for _ in run.epochs(10**6, max_steps=warmup + steps):
        last = time.perf_counter()
        for batch in batches():
            voting = (run.global_step // 10) % 2 == 1
            with run.step():
                if voting:
                    vote.cast(0, -1)
                body(batch)
            now = time.perf_counter()
            if run.global_step > warmup:
                (voted if voting else times).append(now - last)
            last = now
            if run.global_step >= warmup + steps:
                done = True
                break
        if done:
            break

    def timed(call: Any, n: int) -> list[float]:
        out = []
        dist.barrier()
        for _ in range(n):
            began = time.perf_counter()
            call()
            out.append(time.perf_counter() - began)
        return out

    checked = run._state.checked()
    check = timed(lambda: run._loop.check("check-cost"), calls)
    prints = timed(lambda: [fingerprint(obj) for obj in checked.values()], calls)
    gather = timed(lambda: gather_rows([0] * len(checked), device), calls)

    alone = SwitchVote()

    def one_vote() -> None:
        alone.cast(0, -1)
        alone.count(device)

    votes = timed(one_vote, calls)
    began = time.perf_counter()
    for i in range(SEED_CALLS):
        seed_all(step_seed(0, i + 1, rank))
    seeding = (time.perf_counter() - began) / SEED_CALLS
    found = Sample(
        case=case,
        check_every=default_check_every(),
        step=statistics.median(times),
        voted_step=statistics.median(voted),
        check=statistics.median(check),
        fingerprint=statistics.median(prints),
        gather=statistics.median(gather),
        seed=seeding,
        vote=statistics.median(votes),
        objects=len(checked),
    )
    dist.barrier()
    run.finish()
    results.put((rank, asdict(found)))


# ---------------------------------------------------------------- the driver


def measure_once(case: str, timeout: float, parent: Path | None = None) -> Sample:
    """One repetition of ``case``: two spawned ranks, killed if they overrun ``timeout``."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    directory = Path(tempfile.mkdtemp(prefix="check-cost-", dir=parent))
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, port, case, str(directory), results), daemon=True)
        for rank in range(2)
    ]
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        found: dict[int, dict[str, Any]] = {}
        while len(found) < 2:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{case}: no result within {timeout:.0f} s")
            try:
                rank, sample = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{case}: a rank exited {dead[0].exitcode}") from None
                continue
            found[rank] = sample
        ours = Sample(**found[0])
        peer = found[1]
        ours.peer = {k: peer[k] for k in TIMES}
        return ours
    finally:
        stop_spawned(procs, results, directory)


def figures(samples: Sequence[Sample], failures: Sequence[str], case: str) -> list[Figure]:
    """Two rows per case: the agreement check and the step seeding, in percent of a step."""
    every = samples[0].check_every if samples else default_check_every()
    mid = {
        name: statistics.median(getattr(s, name) for s in samples) if samples else None
        for name in TIMES
    }
    check = [per_step(s.check, s.check_every, s.step) for s in samples]
    seed = [per_step(s.seed, 1, s.step) for s in samples]
    vote = [per_step(s.voted_step - s.step, 1, s.step) for s in samples]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.3g} ms"

    note = (
        f"step {ms(mid['step'])}, check {ms(mid['check'])} (fingerprints "
        f"{ms(mid['fingerprint'])} of {samples[0].objects if samples else '-'} objects, "
        f"all-gather {ms(mid['gather'])}), seed_all {ms(mid['seed'])}, a step that votes "
        f"{ms(mid['voted_step'])}, the vote alone {ms(mid['vote'])}; rank 0, medians"
    )

    def row(metric: str, values: list[float]) -> Figure:
        med = statistics.median(values) if values else None
        return Figure(
            SCENARIO,
            case,
            metric,
            "%",
            ours=[round(v, 4) for v in values],
            target=f"< {TARGET:g} %",
            met=None if med is None else med < TARGET,
            failures=list(failures),
            note=note,
        )

    return [
        row(f"agreement check every {every} steps, per step", check),
        row("seed_all at every step, per step", seed),
        row("switch vote at every step, per step", vote),
    ]


def run(reps: int, parent: Path | None = None, timeout: float = 300.0) -> list[Figure]:
    """Every case ``reps`` times, for ``bench.run``."""
    out: list[Figure] = []
    for case in CASES:
        samples: list[Sample] = []
        failures: list[str] = []
        for _ in range(reps):
            try:
                s = measure_once(case, timeout, parent)
            except (TimeoutError, RuntimeError) as exc:
                failures.append(str(exc))
                print(f"{SCENARIO:<12} {case:<17} FAILED: {exc}", flush=True)
                continue
            samples.append(s)
            shown = (
                f"check {per_step(s.check, s.check_every, s.step):.3f} % of a step, "
                f"seed_all {per_step(s.seed, 1, s.step):.3f} %, "
                f"switch vote {per_step(s.voted_step - s.step, 1, s.step):.3f} % "
                f"(step {s.step * 1000:.1f} ms)"
            )
            print(f"{SCENARIO:<12} {case:<17} {shown}", flush=True)
        out += figures(samples, failures, case)
    return out
