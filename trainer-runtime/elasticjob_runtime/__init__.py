"""Trainer runtime: runs inside every worker pod of an ElasticJob.

The public face of the runtime for training scripts::

    from elasticjob_runtime import Run, ElasticSampler

is :data:`__all__`: the training-loop API (:class:`Run`), the sampler, the checkpoint
manager and the errors they raise. The names load on first use, so importing this
package still never imports torch, kopf or kubernetes (the operator imports
:mod:`elasticjob_runtime.contract` for the shared variable names). The modules behind
them are the runtime's own layers (docs/architecture.md); a script that imports one
depends on more than this promises.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elasticjob_runtime.checkpoints.format import CheckpointError, UnsafeCheckpointError
    from elasticjob_runtime.checkpoints.manager import CheckpointManager
    from elasticjob_runtime.training.fingerprint import DivergenceError
    from elasticjob_runtime.training.run import Run
    from elasticjob_runtime.training.sampler import ElasticSampler
    from elasticjob_runtime.training.step_loop import StepBrokeAfterUpdate, StepOutcome

# public name -> the module that defines it
_EXPORTS = {
    "Run": "elasticjob_runtime.training.run",
    "StepBrokeAfterUpdate": "elasticjob_runtime.training.step_loop",
    "StepOutcome": "elasticjob_runtime.training.step_loop",
    "ElasticSampler": "elasticjob_runtime.training.sampler",
    "CheckpointManager": "elasticjob_runtime.checkpoints.manager",
    "CheckpointError": "elasticjob_runtime.checkpoints.format",
    "UnsafeCheckpointError": "elasticjob_runtime.checkpoints.format",
    "DivergenceError": "elasticjob_runtime.training.fingerprint",
}

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "DivergenceError",
    "ElasticSampler",
    "Run",
    "StepBrokeAfterUpdate",
    "StepOutcome",
    "UnsafeCheckpointError",
]


def __getattr__(name: str) -> Any:
    """Load a public name from its module on first use (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'elasticjob_runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
