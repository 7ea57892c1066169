"""ImageNet-style elastic training: a small ResNet under DistributedDataParallel.

The shape of torchelastic's classic ImageNet example (DDP model, elastic sampler,
checkpoints, launched by the elastic agent) on the training-loop API, sized for CPU::

    elasticjob-run --nnodes=1:4 --nproc-per-node=1 --rdzv-endpoint=HOST:2379 \\
        --rdzv-id=imagenet -m elasticjob_examples.imagenet --epochs 2
    python examples/imagenet.py                      # one process, synthetic images
    python examples/imagenet.py --data DIR --val DIR # an ImageFolder-style tree

Synthetic data by default: 32x32 RGB images of a few classes, each class a fixed random
pattern plus noise, generated from the seed (no download), so the loss falls within an
epoch. ``--data DIR`` reads ``DIR/<class>/<image>`` files instead (needs Pillow).

The model is a CIFAR-style ResNet (3 stages of basic blocks) defined here, since
torchvision is not a dependency of the runtime. The training loop is the runtime's
:mod:`~elasticjob_runtime.training.run` API: one optimizer step per global batch through
:class:`~elasticjob_runtime.training.sampler.ElasticSampler`; checkpoints (model, optimizer,
sampler, best accuracy) every ``--checkpoint-interval`` steps and at each epoch's end;
under ``elasticjob-run`` survivors of a fault regroup in place.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from elasticjob_runtime import ElasticSampler, Run, contract

RESULT_PREFIX = "ELASTICJOB_RESULT "
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp")


# ---------------------------------------------------------------- data


class Images:
    """A map-style image dataset: ``len`` and ``get(index) -> (CHW float tensor, label)``."""

    num_classes: int

    def __len__(self) -> int:
        raise NotImplementedError

    def get(self, index: int) -> tuple[torch.Tensor, int]:
        raise NotImplementedError

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        items = [self.get(i) for i in indices]
        if not items:
            return torch.empty(0, 3, 1, 1), torch.empty(0, dtype=torch.long)
        return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


class SyntheticImages(Images):
    """Class ``c`` is a fixed random pattern plus per-image noise, generated from the seed."""

    def __init__(self, size: int, classes: int, image_size: int, seed: int, offset: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.templates = torch.randn(classes, 3, image_size, image_size, generator=gen)
        self.size = size
        self.num_classes = classes
        self.seed = seed
        self.offset = offset  # a validation set is the same distribution at other indices

    def __len__(self) -> int:
        return self.size

    def get(self, index: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.offset + index)
        label = int(torch.randint(self.num_classes, (1,), generator=gen).item())
        noise = torch.randn(self.templates.shape[1:], generator=gen)
        return 0.5 * self.templates[label] + noise, label


class ImageFolder(Images):
    """``root/<class>/<file>`` images, resized to a square and scaled to [-1, 1] (Pillow)."""

    def __init__(self, root: Path, image_size: int) -> None:
        try:
            image_module = importlib.import_module("PIL.Image")  # optional: only for --data
        except ImportError:
            raise SystemExit(
                "imagenet: --data needs Pillow to read images; `pip install pillow`, "
                "or leave out --data to train on synthetic images"
            ) from None
        self._image: Any = image_module
        if not root.is_dir():
            raise SystemExit(f"imagenet: --data {root} is not a directory of class folders")
        classes = sorted(d.name for d in root.iterdir() if d.is_dir())
        self.samples = [
            (path, label)
            for label, name in enumerate(classes)
            for path in sorted((root / name).rglob("*"))
            if path.suffix.lower() in IMAGE_EXTENSIONS
        ]
        if not self.samples:
            raise SystemExit(
                f"imagenet: no images under {root}; expected {root}/<class>/<image>"
                f"{'|'.join(IMAGE_EXTENSIONS)}"
            )
        self.num_classes = len(classes)
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.samples)

    def get(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        with self._image.open(path) as img:
            rgb = img.convert("RGB").resize((self.image_size, self.image_size))
            data = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
        chw = data.view(self.image_size, self.image_size, 3).permute(2, 0, 1).float()
        return chw / 127.5 - 1.0, label


# ---------------------------------------------------------------- model


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style ResNet: a 3x3 stem, three stages (stride 1, 2, 2), global pooling."""

    def __init__(self, num_classes: int, width: int = 16, blocks: int = 1) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        layers: list[nn.Module] = []
        cin = width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for b in range(blocks):
                layers.append(BasicBlock(cin, cout, 2 if stage > 0 and b == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers(self.stem(x))
        logits: torch.Tensor = self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))
        return logits


# ---------------------------------------------------------------- training


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--data", type=Path, help="ImageFolder-style training tree (needs Pillow)")
    p.add_argument("--val", type=Path, help="ImageFolder-style validation tree (with --data)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--classes", type=int, default=10, help="classes of the synthetic data")
    p.add_argument("--synthetic-size", type=int, default=2048, help="synthetic train images")
    p.add_argument("--width", type=int, default=16, help="channels of the first stage")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many (0: no cap)")
    p.add_argument("--checkpoint-dir", default=os.environ.get(contract.CHECKPOINT_DIR))
    p.add_argument("--checkpoint-interval", type=int, default=20, help="steps between saves")
    p.add_argument("--print-freq", type=int, default=10, help="steps between log lines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument(
        "--sigterm-grace",
        type=float,
        default=10.0,
        help="after SIGTERM, seconds to wait for a step boundary before saving anyway",
    )
    args = p.parse_args(argv)
    if args.val and not args.data:
        p.error("--val needs --data")
    for name in ("epochs", "batch_size", "image_size", "classes", "synthetic_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.checkpoint_interval < 1 or args.print_freq < 1:
        p.error("--checkpoint-interval and --print-freq must be at least 1")
    return args


@torch.no_grad()
def validate(model: nn.Module, data: Images, batch_size: int = 128) -> tuple[float, float]:
    """(mean loss, top-1 accuracy %) over ``data``, on this process alone."""
    model.eval()
    loss, correct = 0.0, 0
    for start in range(0, len(data), batch_size):
        x, y = data.batch(range(start, min(len(data), start + batch_size)))
        out = model(x)
        loss += float(F.cross_entropy(out, y, reduction="sum").item())
        correct += int((out.argmax(1) == y).sum().item())
    model.train()
    return loss / len(data), 100.0 * correct / len(data)


def datasets(args: argparse.Namespace) -> tuple[Images, Images | None]:
    if args.data is None:
        train = SyntheticImages(args.synthetic_size, args.classes, args.image_size, args.seed)
        val = SyntheticImages(
            max(256, args.synthetic_size // 8),
            args.classes,
            args.image_size,
            args.seed,
            offset=args.synthetic_size,
        )
        return train, val
    train_folder = ImageFolder(args.data, args.image_size)
    return train_folder, (ImageFolder(args.val, args.image_size) if args.val else None)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    run = Run(
        checkpoint_dir=args.checkpoint_dir or default_checkpoint_dir(),
        checkpoint_interval=args.checkpoint_interval,
        keep=2,
        sigterm_grace=args.sigterm_grace,
    )
    torch.manual_seed(args.seed)
    train_data, val_data = datasets(args)
    model = ResNet(train_data.num_classes, args.width)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    sampler = ElasticSampler(len(train_data), seed=args.seed)
    ddp = run.wrap(model, optimizer, sampler)
    run.meta.setdefault("best_acc1", 0.0)
    if run.rank == 0:
        how = (
            "starting fresh"
            if run.resumed_from == "fresh"
            else f"resumed from step {run.global_step}"
        )
        print(f"{how} world={run.world_size} rank={run.rank} restarts={run.restarts}", flush=True)
    first_loss: float | None = None
    blank = torch.zeros(1, 3, args.image_size, args.image_size)

    for epoch in run.epochs(args.epochs, max_steps=args.max_steps or None):
        for x, y in run.batches(train_data.batch, args.batch_size):
            with run.step() as step:
                # A rank without images at an epoch's uneven end still takes part in the
                # step (DDP reduces on every rank), with a loss of zero.
                out = ddp(x) if len(y) else ddp(blank)
                loss = F.cross_entropy(out, y, reduction="sum") if len(y) else 0.0 * out.sum()
                optimizer.zero_grad(set_to_none=True)
                # the sum over this rank's images, scaled so that DDP's average is the
                # mean over the global batch
                (loss * (run.world_size / run.global_batch)).backward()
                optimizer.step()
            if (
                step.committed
                and run.rank == 0
                and len(y)
                and run.global_step % args.print_freq == 0
            ):
                mean = float(loss.item()) / len(y)
                first_loss = mean if first_loss is None else first_loss
                acc = 100.0 * float((out.argmax(1) == y).float().mean().item())
                print(
                    f"step={run.global_step} epoch={epoch} loss={mean:.4f} acc={acc:.1f} "
                    f"world={run.world_size} rank={run.rank} restarts={run.restarts} "
                    f"regroups={run.regroups} pid={os.getpid()} t={time.time():.3f}",
                    flush=True,
                )
        if sampler.remaining == 0:  # the epoch ended (not --max-steps)
            if run.rank == 0 and val_data is not None:
                val_loss, acc1 = validate(model, val_data)
                run.meta["best_acc1"] = max(run.meta["best_acc1"], acc1)
                print(
                    f"epoch {epoch} done: val_loss={val_loss:.4f} acc1={acc1:.1f} "
                    f"best={run.meta['best_acc1']:.1f}",
                    flush=True,
                )
            run.save()

    run.finish()
    if run.rank == 0:
        result: dict[str, Any] = {
            "first_logged_loss": first_loss,
            "steps": run.global_step,
            "samples_seen": run.samples,
            "epochs": sampler.epoch,
            "best_acc1": run.meta["best_acc1"],
            "world_size": run.world_size,
        }
        if val_data is not None:
            result["val_loss"], result["val_acc1"] = validate(model, val_data)
        print(RESULT_PREFIX + json.dumps(result, sort_keys=True), flush=True)


def default_checkpoint_dir() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or "local"
    return str(Path(tempfile.gettempdir()) / "elasticjob-examples" / run_id / "imagenet")


if __name__ == "__main__":
    main(sys.argv[1:])
