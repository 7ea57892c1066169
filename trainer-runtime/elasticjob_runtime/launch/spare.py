"""A warm spare worker: an interpreter that has imported torch and waits for its round.

Most of a cold worker restart is the new interpreter importing torch and the training
script's own imports (3.5 s of a 3.8 s recovery, measured). The agent
(:mod:`elasticjob_runtime.launch.spare_pool`) therefore keeps one spare per local rank (fewer
with ``--warm-spare-count``), started as ``python [-u] -m elasticjob_runtime.launch.spare ...``
with the environment the agent's workers inherit. The spare imports torch,
``torch.distributed`` and the script's top-level imports (found by parsing the script,
never by running it), then blocks on a Unix socket. When the agent starts a round's
workers it sends the round's launch instead of starting a process: the worker's full
environment and argv, plus the stdout/stderr files torch opened for it (as file
descriptors, so log redirects and tee work unchanged). The spare installs them and runs
the script or module as ``__main__`` in its main thread, exactly as ``python script.py``
would: same ``sys.argv``, ``sys.path[0]``, exit codes, tracebacks and signals.

An idle spare's command line is ``python -u -m elasticjob_runtime.launch.spare --fd=N --parent=P``
(what it will run travels in ``ELASTICJOB_SPARE_*`` variables it removes at once), so
nothing that looks for the training script's processes mistakes a spare for a worker;
once it has its round it takes the worker's own command line (``setproctitle``), so
``ps``, ``top`` and fault injectors see exactly what torch would have started.

The spare dies with the agent: the socket's end of file (the agent exited) ends an
idle spare, and until its launch arrives the kernel kills it if the agent dies
(``PR_SET_PDEATHSIG``); once it runs the script it behaves like any torch worker.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import contextlib
import ctypes
import importlib
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal, NoReturn

from elasticjob_runtime import contract

# Interpreter flags a spare can be started with ahead of time (torchrun passes -u).
SPARE_FLAGS = frozenset({"-u"})
# torch._dynamo: DDP's constructor (and torch.compile) import it on first use; that
# import was 2.5 s of a 4 s warm restart here, so spares pay it ahead of time.
ALWAYS_WARM = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo")
_HEADER = 8  # bytes of the length prefix that carries the file descriptors
# What the spare runs, passed in its environment (not argv, see the module docstring).
TARGET_ENV = "ELASTICJOB_SPARE_TARGET"  # "script:/abs/train.py" or "module:pkg.train"
WARM_IMPORT_ENV = "ELASTICJOB_SPARE_WARM_IMPORT"
WARM = b"w"  # sent by a spare once its imports are done
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Target:
    """What a worker runs: a script path or a module, and the interpreter flags before it."""

    kind: Literal["script", "module"]
    name: str
    flags: tuple[str, ...] = ()


def parse_worker_command(entrypoint: str, args: Sequence[str], python: str) -> Target | None:
    """torchrun's worker command (``python -u [-m] target ...``) as a Target, or None when a
    spare cannot run it (``--no-python``, another interpreter, unknown interpreter flags)."""
    if os.path.realpath(entrypoint) != os.path.realpath(python):
        return None
    flags: list[str] = []
    rest = list(args)
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        if rest[0] not in SPARE_FLAGS:
            return None
        flags.append(rest.pop(0))
    if len(rest) >= 2 and rest[0] == "-m":
        return Target("module", rest[1], tuple(flags))
    if rest and not rest[0].startswith("-"):
        return Target("script", os.path.abspath(rest[0]), tuple(flags))
    return None


def script_argv(target: Target, args: Sequence[str]) -> list[str]:
    """``sys.argv`` for the target from the worker's full argument list (``-m`` keeps the
    module name in ``argv[0]``, which runpy then replaces with the module's file)."""
    rest = list(args)
    while rest and rest[0] in SPARE_FLAGS:
        rest.pop(0)
    return rest[1:] if target.kind == "module" else rest


def _is_main_guard(node: ast.If) -> bool:
    test = node.test
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def top_level_imports(source: str) -> list[str]:
    """Modules a script imports at its top level (inside top-level ``try``/``if`` too, but
    not under ``if __name__ == "__main__"`` or ``TYPE_CHECKING``), in order, no repeats.

    ``from pkg import name`` yields ``pkg`` and ``pkg.name`` (which may be a submodule;
    importing a name that is not one simply fails and is skipped). Relative imports and
    ``__future__`` are left out: they only mean something inside the script itself.
    """
    found: dict[str, None] = {}

    def visit(statements: Iterable[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                found.update((alias.name, None) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level or not node.module or node.module == "__future__":
                    continue
                found[node.module] = None
                found.update((f"{node.module}.{a.name}", None) for a in node.names if a.name != "*")
            elif isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.If) and not (_is_main_guard(node) or _is_type_checking(node)):
                visit(node.body)
                visit(node.orelse)

    visit(ast.parse(source).body)
    return list(found)


def target_source(target: Target) -> str | None:
    """The target's source text, or None when it has none to read (a compiled module)."""
    if target.kind == "script":
        path: str | None = target.name
    else:
        import importlib.util

        try:
            spec = importlib.util.find_spec(target.name)
        except (ImportError, ValueError):
            return None
        path = spec.origin if spec is not None else None
    if not path or not path.endswith(".py"):
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError:
        return None


def warm_up(target: Target, extra: Sequence[str]) -> list[str]:
    """Import what the worker will import, and run torch's first-use paths once
    (first_use.py); returns the modules that failed to import.

    A failure is not an error here: the script's own import raises it where it belongs,
    with the user's traceback.
    """
    source = target_source(target)
    names = [*ALWAYS_WARM, *(top_level_imports(source) if source else []), *extra]
    failed = [name for name in dict.fromkeys(names) if not warm(name)]
    with contextlib.suppress(Exception):  # a speed-up only: the worker pays it if it fails
        from elasticjob_runtime.launch import first_use

        first_use.exercise()
    return failed


def warm(name: str) -> bool:
    """Import ``name`` as a module or, failing that, as ``module.attribute``: a package
    that exports its names lazily (PEP 562, as ``elasticjob_runtime`` does) imports the
    modules behind them only when the attribute is read. Returns whether it worked."""
    try:
        importlib.import_module(name)
        return True
    except Exception:
        pass
    module, _, attribute = name.rpartition(".")
    if not module:
        return False
    try:
        getattr(importlib.import_module(module), attribute)
        return True
    except Exception:
        return False


# ---------------------------------------------------------------- the hand-over


@dataclass(frozen=True)
class WorkerLaunch:
    """A round's worker, as the agent hands it to a spare."""

    args: list[str]  # the worker's argv after the interpreter (flags, target, script args)
    env: dict[str, str]  # the worker's whole environment, as torch would start it
    stdout: bool  # a file descriptor for stdout follows (else: inherit the agent's)
    stderr: bool

    def encode(self) -> bytes:
        doc = {"args": self.args, "env": self.env, "stdout": self.stdout, "stderr": self.stderr}
        return json.dumps(doc).encode()

    @staticmethod
    def decode(raw: bytes) -> WorkerLaunch:
        doc = json.loads(raw)
        return WorkerLaunch(
            [str(a) for a in doc["args"]],
            {str(k): str(v) for k, v in doc["env"].items()},
            bool(doc["stdout"]),
            bool(doc["stderr"]),
        )


def send_launch(sock: socket.socket, launch: WorkerLaunch, fds: Sequence[int]) -> None:
    """Agent side: the length prefix carries the descriptors, the JSON follows."""
    body = launch.encode()
    socket.send_fds(sock, [len(body).to_bytes(_HEADER, "big")], list(fds))
    sock.sendall(body)


def receive_launch(sock: socket.socket) -> tuple[WorkerLaunch, list[int]] | None:
    """Spare side: block until the launch arrives; None when the agent went away."""
    try:
        header, fds, _, _ = socket.recv_fds(sock, _HEADER, 2)
    except OSError:
        return None  # the agent closed the socket before reading our warm byte: ECONNRESET
    head = _read_exactly(sock, _HEADER - len(header), bytearray(header)) if header else None
    body = _read_exactly(sock, int.from_bytes(head, "big"), bytearray()) if head else None
    if body is None:
        for fd in fds:
            os.close(fd)
        return None
    return WorkerLaunch.decode(body), fds


def _read_exactly(sock: socket.socket, size: int, into: bytearray) -> bytes | None:
    """``into`` plus ``size`` more bytes from ``sock``; None if it closes first."""
    while size > 0:
        chunk = sock.recv(size)
        if not chunk:
            return None
        into += chunk
        size -= len(chunk)
    return bytes(into)


def set_parent_death_signal(sig: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def _install(launch: WorkerLaunch, fds: list[int]) -> None:
    """Become the worker torch would have started: its streams, its environment."""
    streams = [fd for fd, wanted in ((1, launch.stdout), (2, launch.stderr)) if wanted]
    for target_fd, fd in zip(streams, fds, strict=True):
        os.dup2(fd, target_fd)
        os.close(fd)
    os.environ.clear()
    os.environ.update(launch.env)
    os.environ[contract.WORKER_ASSIGNED_AT] = f"{time.time():.6f}"


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """Drop this module's and runpy's frames, so a traceback reads as ``python script.py``'s."""
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in ours:
        tb = tb.tb_next
    return tb


def run_target(target: Target, argv: list[str]) -> None:
    """Run the script or module as ``__main__``; an uncaught exception is printed and exits
    1, as the interpreter does (SystemExit passes through untouched)."""
    sys.argv = argv
    try:
        if target.kind == "module":
            runpy.run_module(target.name, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target.name, run_name="__main__")
    except SystemExit:
        raise
    except KeyboardInterrupt:
        traceback.print_exc()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException as exc:
        sys.excepthook(type(exc), exc, _user_frames(exc.__traceback__))
        raise SystemExit(1) from None


def spare_env(target: Target, warm_imports: Sequence[str]) -> dict[str, str]:
    """The variables that tell a spare what to warm up for (see :func:`main`)."""
    return {TARGET_ENV: f"{target.kind}:{target.name}", WARM_IMPORT_ENV: ",".join(warm_imports)}


def _set_title(args: Sequence[str]) -> None:
    """Show the worker's own command line in ps (setproctitle is optional)."""
    with contextlib.suppress(ImportError):
        from setproctitle import setproctitle

        setproctitle(" ".join([sys.executable, *args]))


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m elasticjob_runtime.launch.spare")
    p.add_argument("--fd", type=int, required=True, help="the agent's socket")
    p.add_argument("--parent", type=int, required=True, help="the agent's pid")
    p.add_argument(
        "--template",
        action="store_true",
        help="warm up, then fork spares on the agent's word (spare_template.py)",
    )
    args = p.parse_args(argv)
    set_parent_death_signal(int(signal.SIGKILL))
    if os.getppid() != args.parent:
        return  # the agent died before the death signal was armed
    kind, _, name = os.environ.pop(TARGET_ENV, "").partition(":")
    if kind not in ("script", "module") or not name:
        p.error(f"{TARGET_ENV} must be script:PATH or module:NAME (the agent sets it)")
    target = Target("script" if kind == "script" else "module", name)
    extra = [m for m in os.environ.pop(WARM_IMPORT_ENV, "").split(",") if m.strip()]
    # What `python script.py` / `python -m module` put first on sys.path.
    sys.path[0] = os.path.dirname(target.name) if target.kind == "script" else os.getcwd()
    warm_up(target, extra)
    sock = socket.socket(fileno=args.fd)
    if args.template:
        with contextlib.suppress(OSError):
            sock.sendall(WARM)
        from elasticjob_runtime.launch.spare_template import serve_forks

        forked = serve_forks(sock, args.parent)
        if forked is None:
            return  # the template, and the agent closed it
        sock = forked  # a spare forked from the template: warm already
    serve_one_launch(sock, target)


def serve_one_launch(sock: socket.socket, target: Target) -> None:
    """Say warm, wait for the round's launch, become the worker and run it."""
    with contextlib.suppress(OSError):
        sock.sendall(WARM)  # the agent may wait for this before it joins a round
    received = receive_launch(sock)
    sock.close()
    if received is None:
        return
    launch, fds = received
    set_parent_death_signal(0)  # a worker now: it lives and dies like torch's own
    _set_title(launch.args)
    _install(launch, fds)
    try:
        run_target(target, script_argv(target, launch.args))
    except SystemExit as exc:
        finish(exit_status(exc.code))
    finish(0)


def exit_status(code: object) -> int:
    """The status ``raise SystemExit(code)`` gives, printing a message as Python does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def finish(status: int) -> NoReturn:
    """End the worker as the interpreter would, without tearing down every module.

    With torch loaded that teardown takes about a second, and the agent waits for it
    before every restart. Python does not promise finalizers for objects still alive at
    exit, so this keeps what it does promise: non-daemon threads are waited for, atexit
    handlers run, the streams are flushed.
    """
    shutdown_threads = getattr(threading, "_shutdown", None)
    if shutdown_threads is not None:
        shutdown_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
