"""ImageNet-style elastic training: a small ResNet under DistributedDataParallel.

The shape of torchelastic's classic ImageNet example (DDP model, elastic sampler,
``load_checkpoint``/``save_checkpoint`` around the training loop, launched by the
elastic agent), sized for CPU::

    elasticjob-run --nnodes=1:4 --nproc-per-node=1 --rdzv-endpoint=HOST:2379 \\
        --rdzv-id=imagenet -m elasticjob_examples.imagenet --epochs 2
    python examples/imagenet.py                      # one process, synthetic images
    python examples/imagenet.py --data DIR --val DIR # an ImageFolder-style tree

Synthetic data by default: 32x32 RGB images of a few classes, each class a fixed random
pattern plus noise, generated from the seed (no download), so the loss falls within an
epoch. ``--data DIR`` reads ``DIR/<class>/<image>`` files instead (needs Pillow).

The model is a CIFAR-style ResNet (3 stages of basic blocks) defined here, since
torchvision is not a dependency of the runtime. One optimizer step consumes one global
batch through :class:`~elasticjob_runtime.sampler.ElasticSampler`; checkpoints hold the
model, optimizer, sampler, epoch and best accuracy, are written every
``--checkpoint-interval`` steps and at each epoch's end, and are restored on every rank.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from elasticjob_runtime import contract
from elasticjob_runtime.checkpoint import Checkpoint, CheckpointManager
from elasticjob_runtime.progress import reporter_from_env
from elasticjob_runtime.sampler import ElasticSampler

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


# ---------------------------------------------------------------- checkpoints


@dataclass
class State:
    """What a restart needs besides the model and optimizer (the recipe's State)."""

    epoch: int = 0
    step: int = 0
    samples: int = 0
    best_acc1: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("epoch", "step", "samples", "best_acc1")}


def load_checkpoint(
    ckpt: CheckpointManager, targets: Mapping[str, Any], state: State
) -> Checkpoint | None:
    """Restore the newest checkpoint on every rank (all ranks agree on its step)."""
    found = ckpt.restore(targets)
    if found is not None:
        for key, value in found.state["meta"].items():
            setattr(state, key, value)
    return found


def save_checkpoint(ckpt: CheckpointManager, targets: Mapping[str, Any], state: State) -> None:
    """Save model, optimizer, sampler and ``state`` as step ``state.step`` (rank 0 writes)."""
    ckpt.save({**targets, "meta": state.as_dict()}, state.step)


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


def _init_distributed() -> tuple[int, int]:
    if "RANK" not in os.environ:  # run without a launcher: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


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


def capped_at_epoch_end(sampler: ElasticSampler) -> bool:
    """True when the loop ended at an epoch boundary (the epoch-end save already ran)."""
    return sampler.remaining == 0 or sampler.consumed == 0


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rank, world = _init_distributed()
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(args.seed)
    train_data, val_data = datasets(args)

    model = DistributedDataParallel(ResNet(train_data.num_classes, args.width))
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    sampler = ElasticSampler(len(train_data), seed=args.seed)
    targets = {"model": model, "optim": optimizer, "sampler": sampler}
    state = State()

    run = os.environ.get("TORCHELASTIC_RUN_ID") or "local"
    directory = args.checkpoint_dir or str(
        Path(tempfile.gettempdir()) / "elasticjob-examples" / run / "imagenet"
    )
    ckpt = CheckpointManager(directory, keep=2, memory="TORCHELASTIC_RUN_ID" in os.environ)
    ckpt.install_sigterm_handler(grace_s=args.sigterm_grace)
    ckpt.track(lambda: {**targets, "meta": state.as_dict()})
    resumed = load_checkpoint(ckpt, targets, state)
    if rank == 0:
        how = f"resumed from step {state.step}" if resumed else "starting fresh"
        print(f"{how} world={world} rank={rank} restarts={restarts}", flush=True)
    first_loss: float | None = None
    reporter = reporter_from_env()

    def log(loss: float, acc: float) -> None:
        print(
            f"step={state.step} epoch={state.epoch} loss={loss:.4f} acc={acc:.1f} "
            f"world={world} rank={rank} restarts={restarts} pid={os.getpid()} "
            f"t={time.time():.3f}",
            flush=True,
        )

    def capped() -> bool:
        return bool(0 < args.max_steps <= state.step)

    while state.epoch < args.epochs and not capped():
        sampler.set_epoch(state.epoch)
        while sampler.remaining > 0 and not capped():
            global_n = min(world * args.batch_size, sampler.remaining)
            x, y = train_data.batch(list(itertools.islice(sampler, args.batch_size)))
            out = model(x) if len(y) else model(torch.zeros(1, 3, args.image_size, args.image_size))
            # sum over this rank's images, scaled so DDP's average is the global-batch mean
            loss = F.cross_entropy(out, y, reduction="sum") if len(y) else 0.0 * out.sum()
            optimizer.zero_grad(set_to_none=True)
            (loss * (world / global_n)).backward()
            optimizer.step()
            sampler.advance(world * args.batch_size)
            state.step += 1
            state.samples += global_n
            ckpt.mark_step(state.step)
            if state.step % args.checkpoint_interval == 0:
                save_checkpoint(ckpt, targets, state)
            if reporter is not None:
                reporter.update(state.step, global_n, epoch=state.epoch)
            if rank == 0 and len(y) and state.step % args.print_freq == 0:
                mean = float(loss.item()) / len(y)
                first_loss = mean if first_loss is None else first_loss
                log(mean, 100.0 * float((out.argmax(1) == y).float().mean().item()))
        if sampler.remaining == 0:
            state.epoch += 1
            if rank == 0 and val_data is not None:
                val_loss, acc1 = validate(model.module, val_data)
                state.best_acc1 = max(state.best_acc1, acc1)
                print(
                    f"epoch {state.epoch - 1} done: val_loss={val_loss:.4f} acc1={acc1:.1f} "
                    f"best={state.best_acc1:.1f}",
                    flush=True,
                )
            save_checkpoint(ckpt, targets, state)

    if ckpt.stop_requested:
        ckpt.mark_step(state.step)
    if state.step % args.checkpoint_interval != 0 and not capped_at_epoch_end(sampler):
        save_checkpoint(ckpt, targets, state)  # stopped by --max-steps between saves
    ckpt.close()
    if reporter is not None:
        reporter.close()
    if rank == 0:
        result: dict[str, Any] = {
            "first_logged_loss": first_loss,
            "steps": state.step,
            "samples_seen": state.samples,
            "epochs": state.epoch,
            "best_acc1": state.best_acc1,
            "world_size": world,
        }
        if val_data is not None:
            result["val_loss"], result["val_acc1"] = validate(model.module, val_data)
        print(RESULT_PREFIX + json.dumps(result, sort_keys=True), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
