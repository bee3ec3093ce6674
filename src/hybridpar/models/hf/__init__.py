"""Hugging Face interop: checkpoints <-> ``HybridLM`` (Mamba2, Bamba, NemotronH), their
config.json, the non-weight files of a checkpoint, and any transformers causal LM (load, loss,
generate, export).

Single-device code (no process group). Imports ``models/`` only; imported by ``config``,
``train/`` and above.
"""
