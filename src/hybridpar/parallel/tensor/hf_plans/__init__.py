"""Tensor/sequence-parallel plans for transformers models, registered on import: dense decoders
(``dense``) and mixture-of-experts and recurrent hybrids (``moe_hybrid``).

May import ``models/`` and ``parallel/``; imported by ``parallel/tensor/plans`` only.
"""
