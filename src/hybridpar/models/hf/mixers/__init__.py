"""transformers' recurrent token mixers switched onto hybridpar's cores, one module per kind:
Mamba2 (``mamba2``), Mamba1 (``mamba1``), RecurrentGemma's RG-LRU blocks (``rglru``), gated DeltaNet
(``gdn``), Kimi Delta Attention (``kda``), gated short convolution (``short_conv``). Each recognises
its mixers by structure, installs the document-resetting core behind a ``core`` seam that context
parallelism replaces, and says why a model cannot be switched; ``fallback`` says when a switched mixer
hands over to transformers' own forward (a cache, a padding mask) and when it must refuse to;
``documents`` passes the documents of restarting ``position_ids`` to every mixer when a call gives no
``packed_seq_params`` (as hybridpar's attention reads them).

Single-device code (no process group). Imports ``models/`` and ``data.thd`` only; imported by ``parallel/``
and above.
"""
