"""Tensor/sequence-parallel plans for transformers models, registered on import: dense decoders
(``dense``), mixture-of-experts and recurrent hybrids (``moe_hybrid``), the Mamba1 models, Jamba,
FalconMamba and Mamba (``mamba1``), multi-head latent attention, DeepSeek-V2/V3 (``mla``), and Kimi
Linear, its KDA layers by heads (``kimi_linear``), the attention-sink models other than GPT-OSS (Granite-SWA,
Granite-MoE-SWA, MiMo-V2-Flash, Flint: ``sinks``), RecurrentGemma, its RG-LRU blocks and MQA by heads
(``recurrent_gemma``), Gemma 3n text, its activation-sparse MLPs whole (``gemma3n``), and Llama 4 text, its transposed
experts and in-place shared expert (``llama4``).

May import ``models/`` and ``parallel/``; imported by ``parallel/tensor/plans`` only.
"""
