"""Tensor (and sequence) parallelism: DTensor styles, plans per model family, their registry
and checks, the Mamba2 mixer split by heads, MoE experts, and the vocab-parallel LM head loss.

``apply.apply_tp`` is the entry point (``parallelize`` calls it first). May import ``models/``,
``data/`` and ``parallel/comm``; imported by ``parallel/`` and the layers above it.
"""
