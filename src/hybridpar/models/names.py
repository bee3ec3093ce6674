"""A parameter's or buffer's single-device name inside a wrapped model.

Activation checkpointing, FSDP1 and ``torch.compile`` insert a module level into every name below them
(``layers.0._checkpoint_wrapped_module.mixer.in_proj.weight``); dropping those atoms gives the name the
unwrapped model uses. Here, at the bottom floor, so model code (export) and ``parallel/`` share it.
"""

from __future__ import annotations

__all__ = ["WRAPPER_ATOMS", "canonical_name"]

WRAPPER_ATOMS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")


def canonical_name(name: str) -> str:
    """A parameter name without activation-checkpoint, FSDP1 or ``torch.compile`` wrapper atoms."""
    return ".".join(atom for atom in name.split(".") if atom not in WRAPPER_ATOMS)
