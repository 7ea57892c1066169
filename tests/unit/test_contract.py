"""What the operator (and any torch-free tool) imports from the runtime works without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

TORCH_FREE = (
    "elasticjob_runtime.contract",
    "elasticjob_runtime.records",
    "elasticjob_runtime.etcd_client",
    "elasticjob_runtime.progress",
    "elasticjob_runtime.health",
    "elasticjob_runtime.checkpoint_files",
)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_without_torch(module: str) -> None:
    # A None entry in sys.modules makes every `import torch` raise ImportError.
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        f"import {module}\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert loaded == ['torch'], loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{module} needs torch:\n{done.stderr[-2000:]}"
