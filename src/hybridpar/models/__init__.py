"""Single-device model code: no process group here, ever.

- ``mamba/``: the Mamba2 conv, scan, core op and mixer;
- ``attention/``: the attention mixer, its blockwise core, block visibility, CUDA kernels;
- ``hf/``: Hugging Face checkpoints and transformers causal LMs;
- ``hybrid``, ``blocks``, ``lm_head_loss`` (its blocks: ``lm_head_blocks``), ``generation``: the
  hybrid model, its shared blocks, the chunked LM head loss and cached generation;
- ``names``: a parameter's single-device name inside wrapped modules.
- ``arguments``: the public API's arguments as its rules read them (numpy numbers as Python's, end-token ids).

A bottom floor: imports libraries only, never ``parallel/``, ``config``, ``train/`` or ``plan/``.
"""
