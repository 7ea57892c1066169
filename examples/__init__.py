"""Training examples for elasticjob.

Installed as the ``elasticjob_examples`` package (pyproject maps it to this folder),
so a pod runs ``elasticjob-run ... -m elasticjob_examples.train_regression`` whatever
its working directory: the same command works on the devcluster (the repo's editable
install) and in the runtime image (a regular install). From a checkout,
``python examples/train_regression.py`` and ``python -m examples.train_regression`` work
too: every example imports only torch and ``elasticjob_runtime``.
"""
