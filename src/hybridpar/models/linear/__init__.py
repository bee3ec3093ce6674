"""Linear-attention token mixers with document resets: the gated delta rule (Qwen3-Next, Qwen3.5 and
OLMo-Hybrid's gated DeltaNet) as single-device, pure-PyTorch code.

``gated_delta.py`` holds the chunked gated delta rule whose state resets at every document boundary;
``gdn_core.py`` the whole token-mixing core of a gated DeltaNet layer (short causal conv with document
resets, SiLU, l2-normed q/k, beta, decay, the rule), the seam a context-parallel strategy replaces;
``gdn_fused.py`` the same rule through FLA's ``chunk_gated_delta_rule`` on CUDA (custom ops, the
kernel choice shared with Mamba2's in ``models/mamba/fused.py``); ``selective_scan.py`` Mamba1's
selective scan, on which ``rglru.py`` runs RecurrentGemma's RG-LRU (state size 1). ``kda.py`` holds
Kimi Delta Attention's rule (a decay per key channel, Kimi Linear) with the same resets and states,
``kda_core.py`` its whole core, ``kda_fused.py`` the rule through FLA's ``chunk_kda`` on CUDA;
``delta_ops.py`` registers the two custom ops both fused rules run as, ``delta_backward.py`` their FLA
backward without the forward.
Floor ``models``: imports ``models/`` and ``data/`` only, never a process group; ``models/hf`` and
``parallel/`` import it.
"""
