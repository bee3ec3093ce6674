"""What a run leaves on disk: its output directory and resume plan, DCP checkpoints, metrics,
the export, and the tokenizer trained for it.

May import ``config``, ``models/``, ``data/``, ``parallel/`` and ``train.hf_model`` (which
backend a run's model uses); imported by ``train/`` and above.
"""
