"""The checkpoint layer: saving, reading back and moving a worker's state.

The manager (save, async or on SIGTERM, to the directory and node memory; restore), the
format, the files and their commit markers, the restore and the group's agreement on a
step, the transfer between ranks, the SIGTERM paths and the save's fault reports.
Internal: a training script imports the public face,
``from elasticjob_runtime import CheckpointManager, CheckpointError``, not these modules.
"""
