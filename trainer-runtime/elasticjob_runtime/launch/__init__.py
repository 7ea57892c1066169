"""The launch layer: how a worker starts, on the agent's side.

``elasticjob-run`` and its agent (torchrun's launcher with warm spares, in-place rounds,
hang watching and the probes), the files between agent and workers, the torchrun plugin,
and the one fence around torch's private names. Internal: the public face is
``elasticjob_runtime``.
"""
