"""Training: the loop, the loss, batches, the optimizer, non-finite guards, preflight checks,
``hybridpar check``, the transformers model of a run, and ``run/`` (what a run writes).

May import ``config``, ``models/``, ``data/`` and ``parallel/``; imported by ``plan/``, ``generate``
and ``cli`` only.
"""
