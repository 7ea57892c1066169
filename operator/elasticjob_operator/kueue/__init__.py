"""The job as Kueue sees it: its ``Workload`` (built here, owned by the job), what Kueue's
admission says of it, and what the job does about that (the rule "Queue")."""
