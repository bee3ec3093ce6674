"""Context parallelism for recurrent token mixers: Mamba2 (``mamba``: all-to-all over heads,
``mamba_state``: state passing, also for Mamba1), RecurrentGemma's RG-LRU (``rglru``: state passing on
the same segments), gated DeltaNet (``gdn``), Kimi Delta Attention (``kda``: the gated DeltaNet's two
strategies) and gated short convolutions (``short_conv``: a halo
exchange). Each replaces a mixer's ``core`` seam from outside.

May import ``models/``, ``data/``, ``parallel/comm`` and ``parallel/context``; imported by
``parallel/`` and above.
"""
