"""``elasticjob-devcluster up|down|status``: the local cluster behind ``make cluster``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from elasticjob_devcluster.controlplane import ClusterError, DevCluster


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elasticjob-devcluster", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--dir", type=Path, default=Path(".devcluster"), help="cluster directory")
    parser.add_argument(
        "--nodes", type=int, default=1, help="number of nodes (node agents) to run, default 1"
    )
    parser.add_argument(
        "--kueue", action="store_true", help="also start Kueue (docs/scheduling.md)"
    )
    args = parser.parse_args(argv)
    cluster = DevCluster(args.dir)
    if args.command == "up":
        if args.nodes < 1:
            parser.error("--nodes must be at least 1")
        started = time.monotonic()
        try:
            cfg = cluster.up([f"node-{i}" for i in range(1, args.nodes + 1)])
            if args.kueue:
                cluster.start_kueue()
        except ClusterError as err:
            print(f"elasticjob-devcluster: {err}", file=sys.stderr)
            return 1
        print(
            f"devcluster up in {time.monotonic() - started:.0f}s: API server {cfg.server}, "
            f"nodes {', '.join(cfg.nodes)}{', Kueue' if args.kueue else ''}\n"
            f"  export KUBECONFIG={cluster.kubeconfig}\n"
            f"  kubectl get nodes\n"
            f"stop it with: make cluster-down"
        )
        return 0
    if args.command == "down":
        cluster.down()
        left = cluster.leftover_processes()
        if left:
            names = ", ".join(f"{r.name} (pid {r.pid})" for r in left)
            print(f"elasticjob-devcluster: still running after down: {names}", file=sys.stderr)
            return 1
        print("devcluster stopped; no process left")
        return 0
    current = cluster.config()
    if current is None or not cluster.is_running():
        print("devcluster: not running")
        return 1
    print(f"devcluster: running, API server {current.server}, kubeconfig {cluster.kubeconfig}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
