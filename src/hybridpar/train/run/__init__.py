"""What a run leaves on disk: its output directory and resume plan, DCP checkpoints, metrics,
the export, the tokenizer trained for it, and what a dry run reads of its data.

May import ``config``, ``models/``, ``data/``, ``parallel/``, ``train.hf_model`` (which
backend a run's model uses) and ``train.batches`` (``dry_read``: the packs as training builds them);
imported by ``train/`` and above.
"""
