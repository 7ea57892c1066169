"""The etcd layer: the one client of etcd's v3 API and the records kept there.

The client, where an etcd is and how to trust it, the records the runtime publishes
(and the operator reads back with the same code) and the publisher of progress. Nothing
here imports torch. Internal: the public face is ``elasticjob_runtime``.
"""
