"""Attention: the grouped-query mixer, RoPE with its gradient written out (``rotary``), the blockwise
document-causal core (online softmax, pure PyTorch), which keys each query may see per block, and
the CUDA kernel dispatch.

Single-device code (no process group). Imported by ``models/``, ``parallel/`` and above.
"""
