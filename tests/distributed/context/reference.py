"""Reference helpers the context-parallel tests share, written independently of the library:
a plain loop over zigzag chunks, a plain all-gather, a plain all-reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist


def reference_zigzag(doc_lengths: list[int], cp: int, rank: int) -> list[int]:
    """Global tokens of ``rank``: per document, chunk ``rank`` then chunk ``2cp-1-rank``."""
    out, start = [], 0
    for length in doc_lengths:
        c = length // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            out += range(start + chunk * c, start + (chunk + 1) * c)
        start += length
    return out


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def gather_by_reference(local: torch.Tensor, doc_lengths: list[int], cp: int, group) -> torch.Tensor:
    """Plain all-gather, then put each rank's tokens at its reference zigzag indices."""
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    full = torch.empty(local.shape[0], sum(doc_lengths), *local.shape[2:], dtype=local.dtype)
    for r, part in enumerate(parts):
        full[:, reference_zigzag(doc_lengths, cp, r)] = part
    return full


def summed(t: torch.Tensor, group) -> torch.Tensor:
    out = t.detach().clone()
    dist.all_reduce(out, group=group)
    return out


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def expect_value_error(call, *needles) -> str | None:
    """None if ``call()`` raises a ValueError whose message holds every needle, else what happened."""
    try:
        call()
    except ValueError as error:
        missing = [n for n in needles if n not in str(error)]
        return f"message {str(error)!r} lacks {missing}" if missing else None
    return "no ValueError raised"
