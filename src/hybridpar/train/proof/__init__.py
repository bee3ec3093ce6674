"""``hybridpar check``: the proofs a user runs on their own model and data.

- ``layout``: one step under the configured layout against a single process (loss and every
  gradient, within the dtype's tolerance);
- ``packing`` (``--packing``): packed rows against the same documents one per row.

May import ``config``, ``models/``, ``data/``, ``parallel/`` and ``train/``; imported by ``cli``
and tests only.
"""
