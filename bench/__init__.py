"""Benchmarks: elasticjob-run beside torchrun on the same script (`make bench`)."""
