"""Mamba2: the causal conv with document resets, the chunked SSD scan and its loop-free state
passing, the conv+scan core as one opaque op (``core``), FLA's fused scan behind the same contract
(``fused_op``, its elementwise steps and their gradients written out in ``fused_glue``, FLA's backward
without its forward in ``fla_backward``, chosen by ``fused``), and the mixer with transformers' names.

Single-device code (no process group). May import ``models/blocks``; imported by ``models/``,
``parallel/`` and above.
"""
