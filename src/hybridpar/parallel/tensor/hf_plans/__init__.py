"""Tensor/sequence-parallel plans for transformers models, registered on import: dense decoders
(``dense``), mixture-of-experts and recurrent hybrids (``moe_hybrid``) and the Mamba1 models, Jamba,
FalconMamba and Mamba (``mamba1``).

May import ``models/`` and ``parallel/``; imported by ``parallel/tensor/plans`` only.
"""
