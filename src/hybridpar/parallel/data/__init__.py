"""Data parallelism: FSDP2 units over the data-parallel mesh, and the tensor-parallel layout of
every parameter that FSDP, clipping and checkpoints read.

May import ``models/`` and ``parallel/tensor``; imported by ``parallel/`` and above.
"""
