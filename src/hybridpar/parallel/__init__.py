"""Parallelism applied from outside the model: TP/SP, CP, FSDP2."""
