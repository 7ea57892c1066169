"""``elasticjob-run`` whose agent hands each round after its first to its workers late.

``python slow_delivery_launcher.py <elasticjob-run arguments>`` runs the launcher
unchanged, except that every round after the first is written to the workers' channel
``$ELASTICJOB_TEST_DELIVERY_DELAY`` seconds after the agent formed it. Its workers then
hear of a new round several steps after their peers on other nodes do: the straddle that
agents watching etcd at their own pace produce by chance, made certain.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping

from elasticjob_runtime.launch.channel import AgentChannel
from elasticjob_runtime.launch.launcher import main

DELAY_S = float(os.environ["ELASTICJOB_TEST_DELIVERY_DELAY"])
_deliver = AgentChannel.deliver


def deliver(
    self: AgentChannel, generation: int, envs: Mapping[int, Mapping[str, str]], abort: bool
) -> None:
    if generation > 1:
        print(f"test: delivering round {generation} in {DELAY_S} s", flush=True)
        time.sleep(DELAY_S)
    _deliver(self, generation, envs, abort)


AgentChannel.deliver = deliver  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
