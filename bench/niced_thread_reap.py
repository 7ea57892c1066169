"""`python -m bench.niced_thread_reap`: how long a SIGKILLed process takes to be reaped
when one of its threads runs at nice 19, on cores that other processes fill.

Why the checkpoint writer thread keeps the training's priority (docs/checkpoints.md).
A process with a heap of ``--heap-mb`` (touched, as a trainer's is) runs a busy main
thread and a second thread, which spins or sleeps, at nice 0 or 19; ``--busy``
processes spin beside it. It is SIGKILLed one second after it is ready, and the figure
is the kill to ``wait()`` returning: when its parent, the agent, learns of the death.
Each case ``--reps`` times; every process started here is killed by the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

from bench import side_load

CHILD = """import os, sys, threading
nice, heap_mb, spin = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "spin"
heap = bytearray(heap_mb << 20)
for i in range(0, len(heap), 4096):
    heap[i] = 1
def second():
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    while spin:
        pass
    threading.Event().wait()
threading.Thread(target=second, daemon=True).start()
print("ready", flush=True)
while True:
    pass
"""

BUSY = "import time\nend = time.time() + {s}\nwhile time.time() < end:\n    pass\n"


def reap_seconds(nice: int, heap_mb: int, spin: bool) -> float:
    """One process started, SIGKILLed once ready, and the kill to its reaping."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(nice), str(heap_mb), "spin" if spin else "sleep"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        time.sleep(1.0)
        killed = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        return time.monotonic() - killed
    finally:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.niced_thread_reap")
    p.add_argument("--heap-mb", type=int, default=1024)
    p.add_argument("--busy", type=int, default=3, help="processes spinning beside it")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    cases = [(spin, nice) for spin in (True, False) for nice in (0, 19)]
    bound = 60 + 15 * args.reps * len(cases)
    print(f"a {args.heap_mb} MiB process SIGKILLed beside {args.busy} busy processes:")
    with side_load.alongside([BUSY.format(s=bound)] * args.busy):
        for spin, nice in cases:
            took = [reap_seconds(nice, args.heap_mb, spin) for _ in range(args.reps)]
            what = "spinning" if spin else "sleeping"
            print(
                f"  second thread {what} at nice {nice:2d}: reaped after "
                f"{statistics.median(took) * 1000:7.0f} ms median "
                f"({min(took) * 1000:.0f}-{max(took) * 1000:.0f})",
                flush=True,
            )


if __name__ == "__main__":
    main()
