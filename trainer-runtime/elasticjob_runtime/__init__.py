"""Trainer runtime: runs inside every worker pod of an ElasticJob.

Importing this package must not import torch, kopf or kubernetes; the operator
imports :mod:`elasticjob_runtime.contract` for the shared variable names.
"""
