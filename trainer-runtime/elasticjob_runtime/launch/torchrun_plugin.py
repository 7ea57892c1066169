"""The ``torchrun.handlers`` entry point that makes ``--rdzv-backend=etcd-v3`` work in torchrun.

Kept free of torch imports: torch loads entry points while its rendezvous package is
still initialising, possibly because :mod:`elasticjob_runtime.rendezvous.handler` itself is
being imported, so the handler module is only imported when a handler is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters


def create_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Called once by torch's registry; returns the factory it calls per rendezvous."""

    def build(params: RendezvousParameters) -> RendezvousHandler:
        from elasticjob_runtime.rendezvous.handler import handler_from_params

        return handler_from_params(params)

    return build
