"""What a run leaves on disk: its output directory, DCP checkpoints, metrics, and the tokenizer
trained for it.

May import ``config``, ``models/``, ``data/`` and ``parallel/``; imported by ``train/`` and above.
"""
