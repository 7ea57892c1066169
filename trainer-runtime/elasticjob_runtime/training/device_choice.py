"""Which device a worker trains on: its own GPU, picked by its local rank.

With ``nprocPerNode: gpu`` a node runs one worker per GPU. CUDA's default device is
``cuda:0`` in every process, so unless each worker selects its own, every rank of a node
lands on GPU 0 (out of memory, or NCCL refusing two ranks on one device). The rule is
torchrun's convention: local rank ``i`` trains on ``cuda:i``. A worker whose local rank has
no GPU of its own is an error that says what to change, never a silent share.

``ELASTICJOB_DEVICE`` (or ``Run(device=...)``) overrides the rule: ``cpu`` on a GPU node,
or ``cuda:0`` for every rank, which shares one GPU between processes over gloo (NCCL
refuses that).
"""

from __future__ import annotations

import torch

DEVICE_ENV = "ELASTICJOB_DEVICE"


def choose_device(local_rank: int, gpus: int, asked: str | None = None) -> torch.device:
    """The device of the worker with ``local_rank`` on a node where ``gpus`` CUDA devices
    are visible; ``asked`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``) overrides the rule,
    ``"cuda"`` without an index meaning the local rank's own."""
    if asked:
        try:
            device = torch.device(asked)
        except RuntimeError:
            raise ValueError(
                f"{DEVICE_ENV}={asked!r} is not a device: use cpu, cuda or cuda:N"
            ) from None
        if device.type == "cpu":
            return device
        if device.type != "cuda":
            raise ValueError(f"{DEVICE_ENV}={asked!r}: only cpu and cuda devices are supported")
        if gpus == 0:
            raise ValueError(
                f"{DEVICE_ENV}={asked!r} asks for a GPU, but this process sees none "
                "(CUDA_VISIBLE_DEVICES, the pod's nvidia.com/gpu limit, a CPU-only torch): "
                "give the pod a GPU, or ask for cpu"
            )
        index = local_rank if device.index is None else device.index
        if index >= gpus:
            raise ValueError(
                f"{DEVICE_ENV}={asked!r} gives local rank {local_rank} cuda:{index}, but this "
                f"process sees {gpus} GPU(s): ask for cuda:0 to share one"
            )
        return torch.device("cuda", index)
    if gpus == 0:
        return torch.device("cpu")
    if local_rank >= gpus:
        raise ValueError(
            f"local rank {local_rank} has no GPU of its own: this process sees {gpus} "
            f"(CUDA_VISIBLE_DEVICES, the pod's nvidia.com/gpu limit). Run one worker per GPU "
            f"(nprocPerNode: gpu, or at most {gpus}), or set {DEVICE_ENV}=cuda:0 to share "
            "one GPU over gloo, or cpu"
        )
    return torch.device("cuda", local_rank)


def visible_gpus() -> int:
    """CUDA devices this process sees (0 with a CPU-only torch)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
