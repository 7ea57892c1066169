"""``elasticjob-run`` whose lease keeper is cut off from etcd once a file exists.

``python cut_keeper_launcher.py <elasticjob-run arguments>`` runs the launcher unchanged,
except that once ``$ELASTICJOB_TEST_KEEPER_CUT`` exists, every lease refresh through a
keeper connection opened before then never returns: what the e2e etcd-loss test showed
when the job's etcd pod was replaced (the keeper never refreshed again and logged
nothing). A connection opened after the file appeared reaches etcd as usual, as a new
connection to the Service reaches the new pod. Only the keeper's connections are made
with ``EtcdClient.another``, so nothing else in the agent is touched.

And the keeper's own check of the run's lease, every ``JOB_LEASE_REFRESH_S`` (2 s), never
comes: after the loss only the rules that react to a lease found gone replace it. That
check once won or lost a race with the node's next round, whose store was written under
the run's lease as it was when the round started: lost, a write there was retried under
the dead lease for the store's 300 s (the e2e test's rank 0 "logged no step for 5
minutes"). Here the keeper never wins it: the test passes only if the rules that react
to a lost lease do their part, not by the keeper's timing.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.launch.launcher import main
from elasticjob_runtime.rendezvous import leases

CUT = Path(os.environ["ELASTICJOB_TEST_KEEPER_CUT"])
_another = EtcdClient.another
_never = threading.Event()  # never set: a call on a dead connection that never answers


def another(self: EtcdClient, timeout: float, reconnect_within: float | None = None) -> EtcdClient:
    client = _another(self, timeout, reconnect_within)
    if CUT.exists():
        return client  # opened after the loss: it reaches the new etcd
    refresh = client.refresh

    def cut_off(lease: int) -> bool:
        if CUT.exists():
            _never.wait()
        return refresh(lease)

    client.refresh = cut_off  # type: ignore[method-assign]
    return client


EtcdClient.another = another  # type: ignore[method-assign]
leases.JOB_LEASE_REFRESH_S = 1e9  # type: ignore[misc]  # Final, for this test only

if __name__ == "__main__":
    sys.exit(main())
