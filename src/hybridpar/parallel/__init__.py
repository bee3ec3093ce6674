"""Parallelism applied from outside the model, one room per dimension.

- ``tensor/``: tensor and sequence parallelism (DTensor styles, plans per model family, the plan
  registry and its checks, the Mamba2 head split, MoE experts, the vocab-parallel loss);
- ``context/``: context parallelism (zigzag layout, ``shard_inputs``, attention strategies
  allgather/ulysses/ring, Mamba2 strategies a2a/state, the transformers attention bridge);
- ``data/``: data parallelism (FSDP2 units, the layout of every parameter);
- ``comm/``: autograd-aware collectives, their byte counts, the closed forms of a step;
- ``dims``, ``parallelize``, ``checkpointing``, ``state``: the mesh, the one fixed order that ties
  the rooms together, activation checkpointing, and layout-free state dicts.

May import ``models/`` and ``data/`` (the package ``hybridpar.data``); never ``config``,
``train/`` or ``plan/``. Imported by ``train/``, ``plan/`` and library users.
"""
