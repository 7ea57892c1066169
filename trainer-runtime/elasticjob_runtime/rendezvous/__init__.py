"""The rendezvous layer: the ``etcd-v3`` handler and its parts.

The rules (pure), the join loop and its executor, the reads and the round key's writes,
the keys, the leases and the round watch, and the per-round Store in etcd. Internal:
torch reaches it by the backend name, the agent through the handler; the public face is
``elasticjob_runtime``.
"""
