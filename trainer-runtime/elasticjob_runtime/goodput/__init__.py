"""Goodput: where each second of a run went (ledger.py, pure), kept by rank 0's step
loop (keeper.py) and shown by the operator as the job's ``status.goodput``."""
