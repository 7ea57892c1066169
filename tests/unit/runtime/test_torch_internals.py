"""The private names of torch the runtime depends on (torch_internals.py) still exist in
the installed torch, with the parameters we call them with.

Each failure names the name and the torch version: that is where a torch upgrade breaks
the runtime, and this says so before a user finds out.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from elasticjob_runtime.launch import torch_internals
from elasticjob_runtime.launch.torch_internals import (
    AGENT_ATTRIBUTES,
    AGENT_HOOKS,
    AGENT_SIGNALS,
    CONTEXT_HOOKS,
    HANDLER_ATTRIBUTES,
    PRIVATE_NAMES,
)

RUNTIME = Path(torch_internals.__file__).parents[1]  # elasticjob_runtime/, every layer
GONE = "torch {version} has no {name}: the runtime's fence (torch_internals.py) must follow it"


@pytest.mark.parametrize(("module", "name"), PRIVATE_NAMES)
def test_every_private_module_name_exists(module: str, name: str) -> None:
    found = importlib.import_module(module)
    assert hasattr(found, name), GONE.format(version=torch.__version__, name=f"{module}.{name}")


@pytest.mark.parametrize(("hook", "params"), AGENT_HOOKS.items())
def test_every_agent_hook_exists_with_our_parameters(hook: str, params: tuple[str, ...]) -> None:
    method = getattr(LocalElasticAgent, hook, None)
    assert callable(method), GONE.format(
        version=torch.__version__, name=f"LocalElasticAgent.{hook}"
    )
    got = tuple(inspect.signature(method).parameters)[1:]
    assert got == params, f"torch {torch.__version__}: LocalElasticAgent.{hook}{got}, not {params}"


class _NoRendezvous:
    def get_run_id(self) -> str:
        return "fence-test"


def _agent() -> LocalElasticAgent:
    spec = WorkerSpec(
        role="default",
        local_world_size=1,
        rdzv_handler=_NoRendezvous(),  # type: ignore[arg-type]
        entrypoint="python",
        args=("-c", "pass"),
    )
    return LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs())


def test_every_agent_attribute_is_set_by_torchs_constructor() -> None:
    agent = _agent()
    missing = [name for name in AGENT_ATTRIBUTES if not hasattr(agent, name)]
    assert not missing, GONE.format(
        version=torch.__version__, name=f"LocalElasticAgent attributes {missing}"
    )


@pytest.mark.parametrize(("name", "since"), AGENT_SIGNALS.items())
def test_every_attribute_we_set_for_torch_exists_from_its_first_torch(
    name: str, since: str
) -> None:
    """Set for torch's health check to read: from the torch that has it on, a rename would
    leave us setting what nobody reads; before it, torch has none to read."""
    if torch.__version__ < since:
        pytest.skip(f"torch {torch.__version__} has no {name} before {since}: nothing to set")
    assert hasattr(_agent(), name), GONE.format(
        version=torch.__version__, name=f"LocalElasticAgent.{name}"
    )


def test_the_process_context_and_handler_names_exist() -> None:
    for hook in CONTEXT_HOOKS:
        assert hook in vars(SubprocessContext), GONE.format(
            version=torch.__version__, name=f"SubprocessContext.{hook}"
        )
    source = inspect.getsource(SubprocessHandler)
    for attribute in HANDLER_ATTRIBUTES:
        assert f"self.{attribute}" in source, GONE.format(
            version=torch.__version__, name=f"SubprocessHandler.{attribute}"
        )


def _private_torch_names(path: Path) -> list[str]:
    """``torch.x._y`` attributes, ``from torch... import _y`` and ``super()._y`` (the
    runtime's classes that have a base class of their own subclass torch's) in one
    module's code."""
    tree = ast.parse(path.read_text())
    found: list[str] = []
    torch_modules = {"torch", "dist", "agent_api", "local_elastic_agent", "launcher_api"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            if any(part.startswith("_") for part in (node.module or "").split(".")):
                found.append(node.module or "")
            found += [a.name for a in node.names if a.name.startswith("_")]
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not (node.attr.startswith("__"))
        ):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in torch_modules:
                found.append(ast.unparse(node))
            # super()._hook(): a private method of a torch base class
            if isinstance(base, ast.Call) and ast.unparse(base.func) == "super":
                found.append(ast.unparse(node))
            if (
                isinstance(base, ast.Name)
                and base.id == "self"
                and node.attr in {*AGENT_ATTRIBUTES, *AGENT_SIGNALS}
            ):
                found.append(ast.unparse(node))
    return found


def test_no_other_runtime_module_names_a_private_torch_name() -> None:
    """The fence holds only if nothing goes around it."""
    outside = {
        str(path.relative_to(RUNTIME)): names
        for path in sorted(RUNTIME.rglob("*.py"))
        if path.name != "torch_internals.py" and (names := _private_torch_names(path))
    }
    assert not outside, f"private torch names outside torch_internals.py: {outside}"


def test_a_grad_scaler_forgets_an_unscale_so_a_dropped_step_can_be_retried() -> None:
    model = torch.nn.Linear(2, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(optim)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(optim)  # what a retried step met before the Run forgot it
    torch_internals.forget_unscale(scaler)
    scaler.unscale_(optim)  # the retry's own unscale_
    scaler.step(optim)
    scaler.update()
