"""Trainer, loss, checkpoints and metrics."""
