"""The public API's arguments as its value rules read them.

A number computed with numpy or torch is the Python number it stands for: the rules are written for ``int`` and
``float``, and refused ``np.int64(64)`` as "must be a positive integer" and ``np.float32(0.9)`` as "top_p must be in
(0, 1]", of values that are. End-token ids are checked against the vocabulary (a string or a numpy id was a
``TypeError`` traceback, an id outside the vocabulary never ended a row).
"""

from __future__ import annotations

import numbers

import torch

from hybridpar.config_rules import quoted

__all__ = ["python_number", "python_numbers", "end_token_ids"]


def python_number(value):
    """``value`` as a Python ``int`` or ``float`` when it is a numpy scalar or a 0-d torch tensor of a number; any
    other value (a bool, a string, a list, ``None``, ``np.bool_``) unchanged, for the caller's rule to refuse."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        usable = value.dim() == 0 and value.dtype != torch.bool and not value.is_complex()
        return value.item() if usable else value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def python_numbers(owner, names) -> None:
    """Each attribute of ``owner`` in ``names`` through ``python_number`` (a frozen dataclass too)."""
    for name in names:
        object.__setattr__(owner, name, python_number(getattr(owner, name)))


def end_token_ids(eos_token_id, vocab_size: int) -> list[int]:
    """``eos_token_id`` (None, one id, or a list, tuple or tensor of ids) as a list of ids in ``[0, vocab_size)``;
    ``ValueError`` in one line for anything else."""
    if eos_token_id is None:
        return []
    ids = eos_token_id.tolist() if isinstance(eos_token_id, torch.Tensor) else eos_token_id
    ids = [python_number(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]
    wrong = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size]
    if wrong:
        raise ValueError(f"eos_token_id={quoted(eos_token_id)} must be a token id or a list of them, each an integer in "
                         f"[0, vocab_size={vocab_size}) (got {quoted(wrong[0])}); pass the tokenizer's end token id, or "
                         "None to generate max_new_tokens tokens.")
    return ids
