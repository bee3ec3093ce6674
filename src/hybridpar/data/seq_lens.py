"""Per-document lengths of a batch: from ``seq_lens`` (sentinel-padded ``[B, max_packs]``)
or, without them, from right-padded token ids. Every rule a batch's lengths must keep is
checked here, with the fix in the message."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def as_lengths(value: Any, name: str, rows: int) -> Tensor:
    """``[B, K]`` integer tensor from a tensor or nested list; ragged input is an error."""
    if not isinstance(value, Tensor):
        try:
            value = torch.as_tensor(value)
        except (ValueError, TypeError) as error:
            raise ValueError(
                f"{name} is ragged ({error}); pad every row to [B, max_packs] with the sentinel "
                f"(collate_thd does this)."
            ) from None
    if value.is_floating_point() or value.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer lengths, got dtype {value.dtype}; cast with .long().")
    if value.dim() == 1 and rows == 1:
        value = value[None]
    if value.dim() != 2 or value.shape[0] != rows:
        raise ValueError(
            f"{name} has shape {tuple(value.shape)} but the batch has {rows} rows; it must be [B, max_packs] "
            "with the sentinel in empty slots."
        )
    return value.long()


def lengths_from_seq_lens(seq_lens, seq_lens_padded, rows: int, seq_len: int, sentinel: int) -> tuple[Tensor, Tensor]:
    """Real and padded lengths ``[n_docs]`` in document order; each row's padded lengths sum to S."""
    real_2d = as_lengths(seq_lens, "seq_lens", rows)  # [B, K]
    padded_2d = real_2d if seq_lens_padded is None else as_lengths(seq_lens_padded, "seq_lens_padded", rows)
    valid = real_2d != sentinel  # [B, K]
    if padded_2d.shape != real_2d.shape or not torch.equal(valid, padded_2d != sentinel):
        raise ValueError(
            f"seq_lens {real_2d.tolist()} and seq_lens_padded {padded_2d.tolist()} must have the same shape and the "
            f"sentinel {sentinel} in the same slots; build both from the same packs."
        )
    empty_rows = torch.nonzero(valid.sum(dim=1) == 0).flatten().tolist()
    if empty_rows:
        raise ValueError(f"rows {empty_rows} of seq_lens hold no document (all {sentinel}); drop empty rows.")
    real, padded = real_2d[valid], padded_2d[valid].clone()  # [n_docs]
    if bool((real <= 0).any()):
        raise ValueError(
            f"seq_lens must be positive, got {real.tolist()}; mark empty slots with the sentinel "
            f"{sentinel} and drop empty documents."
        )
    if bool((padded < real).any()):
        raise ValueError(
            f"a padded length is shorter than its real length: seq_lens {real.tolist()} vs seq_lens_padded "
            f"{padded.tolist()}; seq_lens_padded must include the document's own tokens."
        )
    row_sums = torch.where(valid, padded_2d, 0).sum(dim=1)  # [B]
    if bool((row_sums > seq_len).any()):
        raise ValueError(
            f"(padded) document lengths per row {row_sums.tolist()} exceed the row length {seq_len}; the lengths must "
            "describe tokens that are in the row: pack with a larger pack_size or fix seq_lens."
        )
    last_of_row = torch.cumsum(valid.sum(dim=1), dim=0) - 1  # [B]
    padded[last_of_row] += seq_len - row_sums  # the rest of a row belongs to its last document
    return real, padded


def lengths_from_token_ids(input_ids: Tensor, padding_token_id: int) -> tuple[Tensor, Tensor]:
    """Fallback without ``seq_lens``: each row is one document, right-padded with the pad id."""
    if input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(
            f"without seq_lens padding is read from token ids, but input_ids has shape {tuple(input_ids.shape)} "
            f"and dtype {input_ids.dtype}; pass seq_lens (and seq_lens_padded) with embeddings."
        )
    rows, seq_len = input_ids.shape
    is_pad = input_ids == padding_token_id  # [B, S]
    real = (~is_pad).sum(dim=1)  # [B]
    right_padded = torch.arange(seq_len, device=input_ids.device)[None, :] >= real[:, None]
    if not torch.equal(is_pad, right_padded):
        raise ValueError(
            f"padding_token_id={padding_token_id} also occurs as content (not only as one right-padded run per "
            "row), so padding cannot be read from token ids; pass seq_lens/seq_lens_padded or an unused pad id."
        )
    if bool((real == 0).any()):
        raise ValueError(f"rows {torch.nonzero(real == 0).flatten().tolist()} are all padding; drop them.")
    return real.long(), torch.full((rows,), seq_len, dtype=torch.long, device=input_ids.device)
