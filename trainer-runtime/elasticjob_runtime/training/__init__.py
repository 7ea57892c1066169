"""The training layer: what runs inside each trainer process.

The Run and its parts (the step rule, the round a worker is in, the state it trains,
the ranks' agreement, the loader, the sampler, seeds and fingerprints, the round's
process group). Internal: a training script imports the public face,
``from elasticjob_runtime import Run, ElasticSampler``, not these modules.
"""
