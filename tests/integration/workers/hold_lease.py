"""An agent's rendezvous in a process of its own, for the lease tests.

``python hold_lease.py ENDPOINT RUN_ID NNODES SECONDS [--busy] [--lease-ttl=N]`` builds the
etcd-v3 handler the way torchrun does (``lease_ttl`` at its default unless given), joins
one round, prints
``joined <node> <rank> <world size>`` and then holds its lease until SECONDS have passed,
with ``--busy`` spinning its main thread in Python all the while (the keeper thread must
still get the GIL). Its logging goes to stderr. It exits by itself at the deadline.
"""

from __future__ import annotations

import logging
import sys
import time

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler


def main(argv: list[str]) -> int:
    endpoint, run_id, nnodes, seconds = argv[:4]
    busy = "--busy" in argv[4:]
    ttl = [a.split("=", 1)[1] for a in argv[4:] if a.startswith("--lease-ttl=")]
    deadline = time.monotonic() + float(seconds)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    lo, _, hi = nnodes.partition(":")
    params = RendezvousParameters(
        backend="etcd-v3",
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=int(lo),
        max_nodes=int(hi or lo),
        local_addr="127.0.0.1",
        join_timeout="60",
        **({"lease_ttl": ttl[0]} if ttl else {}),
    )
    handler = get_rendezvous_handler(params)
    info = handler.next_rendezvous()
    node = getattr(handler, "node", "?")
    print(f"joined {node} {info.rank} {info.world_size}", flush=True)
    spins = 0
    while time.monotonic() < deadline:
        if busy:
            for _ in range(10_000):
                spins += 1
        else:
            time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
