"""A one-process ``Run`` that stops in step ``GATE_STEP`` until the file ``GATE``
exists: a SIGTERM then reaches a worker whose training thread is about to change the
state, as when the agent wakes a frozen peer to save and its blocked collective completes.

``GATE_AT=mid`` (default) stops in the optimizer's update, one parameter updated and the
rest not, after printing ``mid-update``. ``GATE_AT=before`` stops just before
``optimizer.step()``, after printing ``before-update``; a save off the training thread
then opens the gate itself and takes a second more, so the update is free to run while
the save serialises unless something holds it off.

Every ``CHECKPOINT_INTERVAL`` steps the Run checkpoints to ``CKPT_DIR``; ``SIGTERM_GRACE``
is the Run's ``sigterm_grace``. The training is deterministic and full-batch, so a test
rebuilds the state at any step in its own process (:func:`reference`) and compares.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

SAMPLES = 10_000  # the sampler's epoch: far more steps than any test takes


class GatedSGD(torch.optim.Optimizer):
    """SGD with momentum, one parameter at a time; update number ``gated`` waits for
    the file ``gate`` after its first parameter."""

    def __init__(
        self, params: Iterable[Any], gated: int | None = None, gate: Path | None = None
    ) -> None:
        super().__init__(params, {"lr": 0.1, "momentum": 0.9})
        self.updates = 0
        self.gated, self.gate = gated, gate

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.updates += 1
        first = True
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].get("momentum_buffer")
                if buf is None:
                    buf = self.state[p]["momentum_buffer"] = p.grad.clone()
                else:
                    buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])
                if first and self.updates == self.gated and self.gate is not None:
                    print("mid-update", flush=True)
                    while not self.gate.exists():
                        time.sleep(0.01)
                first = False


class Gate:
    """The file the test (or a save, :class:`SlowSave`) creates to let the step go on."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.waiting = False

    def wait(self, said: str) -> None:
        self.waiting = True
        print(said, flush=True)
        while not self.path.exists():
            time.sleep(0.01)
        self.waiting = False


class SlowSave:
    """A Stateful saved with the rest: while the training thread waits at the gate
    (so this save is off that thread), it opens the gate and takes a second."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def state_dict(self) -> dict[str, Any]:
        if self.gate.waiting:
            self.gate.path.touch()
            time.sleep(1.0)
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=gen)
    return x, x.sum(dim=1, keepdim=True).sin()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def loss(net: torch.nn.Module) -> torch.Tensor:
    x, y = data()
    return (net(x) - y).pow(2).mean()


def reference(steps: int) -> dict[str, Any]:
    """Model and optimizer state after ``steps`` ungated steps, as a checkpoint holds them."""
    torch.set_num_threads(1)
    net = model()
    optim = GatedSGD(net.parameters())
    for _ in range(steps):
        optim.zero_grad()
        loss(net).backward()
        optim.step()
    return {"model": net.state_dict(), "optim": optim.state_dict()}


def main() -> None:
    from elasticjob_runtime import ElasticSampler, Run

    torch.set_num_threads(1)
    run = Run(
        checkpoint_dir=os.environ["CKPT_DIR"],
        checkpoint_interval=int(os.environ.get("CHECKPOINT_INTERVAL", "2")),
        sigterm_grace=float(os.environ["SIGTERM_GRACE"]),
        in_place=False,
    )
    net = model()
    gate, gate_step = Gate(Path(os.environ["GATE"])), int(os.environ["GATE_STEP"])
    mid = os.environ.get("GATE_AT", "mid") == "mid"
    optim = GatedSGD(net.parameters(), gate_step if mid else None, gate.path)
    ddp = run.wrap(net, optim, ElasticSampler(SAMPLES, seed=0), state={"slow": SlowSave(gate)})
    for _ in run.epochs(1):
        for _batch in run.batches(lambda indices: indices, batch_size=1):
            with run.step():
                optim.zero_grad()
                loss(ddp).backward()
                if not mid and run.global_step + 1 == gate_step:
                    gate.wait("before-update")
                optim.step()
            print(f"step {run.global_step}", flush=True)


if __name__ == "__main__":
    main()
