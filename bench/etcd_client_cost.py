"""`python -m bench.etcd_client_cost`: the CPU an agent's etcd client takes while nothing
happens, by part: gRPC's idle stream threads, a watch, the lease refreshes.

In a steady round our agent takes about 3 ms of CPU a step against torchrun's 1 ms
(bench/README.md, "The realistic script beside its plain original"). This splits the
client's share on a real etcd (the bench's, on loopback), one client in one process at a
time, each case twice:

* ``idle``: an open keep-alive stream, nothing sent;
* ``watch``: the same and a prefix watch on keys nobody writes;
* ``refresh``: the lease refreshed three times a second (the runtime's 1 s lease);
* ``watch+refresh``: what an agent's connection does in a steady round.

Each case also runs with gRPC's stream-wait poll (``grpc._common.MAXIMUM_WAIT_TIMEOUT``,
0.1 s: each thread waiting on a stream wakes ten times a second so that signal handlers
run) raised to 1 s, to size what that poll costs. This is a measurement only: nothing in
the runtime changes that private knob.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import Etcd

CASES = ("idle", "watch", "refresh", "watch+refresh")
REFRESH_EVERY_S = 1 / 3  # lease_holder's interval for the runtime's 1 s lease
WAITS = (0.1, 1.0)  # gRPC's default stream-wait poll, and ten times longer

_ONE_CASE = """
import sys, time
case, wait, endpoint, seconds = sys.argv[1], float(sys.argv[2]), sys.argv[3], float(sys.argv[4])
import grpc._common
grpc._common.MAXIMUM_WAIT_TIMEOUT = wait
from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.etcd.endpoints import parse_endpoints
client = EtcdClient(parse_endpoints(endpoint))
lease = client.grant(5)
if "watch" in case:
    client.watch_prefix("bench-idle/", 0, lambda: None)
client.refresh(lease)  # the keep-alive stream is open in every case
time.sleep(2)
cpu, start = time.process_time(), time.monotonic()
while time.monotonic() - start < seconds:
    if "refresh" in case:
        client.refresh(lease)
    time.sleep(REFRESH)
print(1000 * (time.process_time() - cpu) / seconds)
"""


def measure(case: str, wait: float, endpoint: str, seconds: float) -> float:
    """ms of CPU per second of one client process in ``case``."""
    code = _ONE_CASE.replace("REFRESH", repr(REFRESH_EVERY_S))
    out = subprocess.run(
        [sys.executable, "-c", code, case, str(wait), endpoint, str(seconds)],
        check=True,
        capture_output=True,
        text=True,
        timeout=seconds + 60,
    ).stdout
    return float(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.etcd_client_cost")
    p.add_argument("--seconds", type=float, default=15.0, help="length of each window")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = p.parse_args(argv)
    rows: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="elasticjob-bench-") as tmp:
        etcd = Etcd.start(Path(tmp) / "etcd")
        try:
            for _ in range(args.reps):
                for case in CASES:
                    for wait in WAITS:
                        ms = measure(case, wait, etcd.endpoint, args.seconds)
                        rows.setdefault(case, {}).setdefault(f"wait {wait} s", []).append(ms)
        finally:
            etcd.stop()
    print("| client doing | " + " | ".join(f"gRPC wait {w} s" for w in WAITS) + " |")
    print("|---|" + "---|" * len(WAITS))
    for case, by_wait in rows.items():
        cells = [f"{min(v):.1f}-{max(v):.1f} ms/s" for v in by_wait.values()]
        print(f"| {case} | " + " | ".join(cells) + " |")
    if args.out is not None:
        doc = {
            "date": time.strftime("%Y-%m-%dT%H:%M"),
            "seconds": args.seconds,
            "ms_cpu_per_s": rows,
        }
        args.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
