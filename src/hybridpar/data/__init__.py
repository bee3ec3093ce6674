"""Packed (THD) batches: ``PackedSeqParams``, the packer and collators, the built-in sources,
tokenizers, chat templates and local datasets.

A bottom floor beside ``models/``: imports libraries only; imported by
``parallel/`` and above.
"""
