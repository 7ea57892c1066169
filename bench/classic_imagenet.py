"""An ImageNet-style script written the classic torchelastic way, run unchanged.

The shape of the archived TorchElastic ImageNet example, as people still write elastic
scripts for torchrun: ``init_process_group`` from the launcher's environment, a
torchvision-sized ResNet-18 (11.7M parameters, built here: torchvision is not a
dependency), ``ElasticDistributedSampler`` with a ``start_index`` from the checkpoint,
a ``DataLoader`` with worker processes, ``torch.save``/``torch.load`` of its own
checkpoint (model, optimizer, epoch, position) every ``--checkpoint-interval`` steps,
SGD with momentum. It knows nothing of elasticjob: every fault restarts it.

Images are synthetic (generated per index from the seed: no download) and small
(``--image-size``, 64 by default) so a step takes a fraction of a second on 2 CPU cores;
the model is full width, so building it, wrapping it in DDP and loading its checkpoint
cost what they cost in the real example.

Logs, with unix times, what the bench needs to split a restart into its phases:
``startup phase=<name> t=`` after the imports, the process group, the model, DDP, the
checkpoint load, the data loader, and ``step=N ... world= pid= t=`` after every step.
"""

from __future__ import annotations

import time

IMPORTED_AT = time.time()

import argparse  # noqa: E402  (the import time above is the first thing measured)
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.elastic.utils.data.elastic_distributed_sampler import (  # noqa: E402
    ElasticDistributedSampler,
)
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402


def phase(name: str) -> None:
    print(f"startup phase={name} pid={os.getpid()} t={time.time():.3f}", flush=True)


class BasicBlock(nn.Module):
    def __init__(self, inp: int, out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.down: nn.Module = nn.Identity()
        if stride != 1 or inp != out:
            self.down = nn.Sequential(
                nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.down(x))


def resnet18(classes: int) -> nn.Module:
    """torchvision's resnet18 layout: 11.7M parameters at 1000 classes."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    inp = 64
    for out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(inp, out, stride), BasicBlock(out, out, 1)]
        inp = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


class SyntheticImages(Dataset[tuple[torch.Tensor, int]]):
    """Image ``i``: its class's fixed pattern plus noise, both from the seed."""

    def __init__(self, size: int, classes: int, image_size: int, seed: int) -> None:
        self.size, self.classes, self.image_size, self.seed = size, classes, image_size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        label = index % self.classes
        pattern = torch.Generator().manual_seed(self.seed * 7919 + label)
        noise = torch.Generator().manual_seed(self.seed * 104729 + index)
        shape = (3, self.image_size, self.image_size)
        image = torch.randn(shape, generator=pattern) + 0.5 * torch.randn(shape, generator=noise)
        return image, label


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--steps", type=int, default=1_000_000, help="stop after this many steps")
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--checkpoint-file", default="/tmp/classic-imagenet/checkpoint.pth.tar")
    p.add_argument("--checkpoint-interval", type=int, default=20, help="steps between saves")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each step")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    phase("imports")
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    phase("process_group")
    torch.manual_seed(0)
    model = resnet18(args.classes)
    optim = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    phase("model")
    # the classic example loads on every rank, then DDP broadcasts rank 0's parameters
    step, epoch, start_index = 0, 0, 0
    ckpt = Path(args.checkpoint_file)
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optimizer"])
        step, epoch, start_index = state["step"], state["epoch"], state["start_index"]
    phase("checkpoint")
    ddp = DDP(model)
    phase("ddp")
    dataset = SyntheticImages(args.samples, args.classes, args.image_size, seed=0)
    loss_fn = nn.CrossEntropyLoss()
    first_loader = True
    while epoch < args.epochs and step < args.steps:
        sampler = ElasticDistributedSampler(dataset, start_index=start_index)
        sampler.set_epoch(epoch)
        loader = DataLoader(
            dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers
        )
        for images, labels in loader:
            if first_loader:
                phase("loader")  # its workers forked and the first batch arrived
                first_loader = False
            loss = loss_fn(ddp(images), labels)
            optim.zero_grad()
            loss.backward()
            optim.step()
            step += 1
            start_index += args.batch_size * world
            print(
                f"step={step} epoch={epoch} loss={float(loss):.4f} world={world} rank={rank} "
                f"pid={os.getpid()} t={time.time():.3f}",
                flush=True,
            )
            if rank == 0 and step % args.checkpoint_interval == 0:
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                state = {"model": model.state_dict(), "optimizer": optim.state_dict(),
                         "step": step, "epoch": epoch, "start_index": start_index}  # fmt: skip
                torch.save(state, ckpt.with_suffix(".tmp"))
                os.replace(ckpt.with_suffix(".tmp"), ckpt)
            if args.sleep:
                time.sleep(args.sleep)
            if step >= args.steps:
                break
        epoch, start_index = epoch + 1, 0
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
