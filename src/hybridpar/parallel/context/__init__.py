"""Context parallelism: the zigzag layout and ``shard_inputs``, attention strategies
(``allgather``, ``ulysses``, ``ring``) and Mamba2 strategies (``a2a``, ``state``) that replace a
mixer's core from outside, and the bridge to transformers' attention interface.

May import ``models/``, ``data/`` and ``parallel/comm``; imported by ``parallel/`` and above.
"""
