"""Packed documents told by ``position_ids`` alone, for the switched token mixers.

A switched mixer (Mamba2, Mamba1, RG-LRU, gated DeltaNet, KDA, short conv) resets its state at the
documents of ``packed_seq_params``; without them it runs the row as one document. hybridpar's
attention (``parallel/context/hf.py``) also takes the documents of ``position_ids`` when no
``packed_seq_params`` come (a new document where the ids do not continue by 1, transformers' packing
rule, as a flattening collator writes them). A call with such ids only therefore kept the attention
of two documents apart and let the recurrent state of one reach the next: a silently wrong loss.

``use_position_documents(model)`` registers a forward pre-hook on the model (and its base model) that,
when ``position_ids [B, T]`` restart inside the row and no ``packed_seq_params`` are given, passes the
documents they describe as ``packed_seq_params`` (``PackedSeqParams.from_cu_seqlens``) to every layer,
so every mixer and the attention reset at the same tokens. Rows of different layouts are refused in one
line (one ``PackedSeqParams`` serves the batch). With a cache or a padding ``attention_mask``
(generation, left padding: there position ids are built from the mask) nothing is added and
transformers' own forward serves the call as before. One host sync per such call; the trainer always
passes ``packed_seq_params`` and never pays it.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridpar.data.thd import PackedSeqParams

__all__ = ["use_position_documents", "documents_from_position_ids"]

_HOOKED = "_hybridpar_position_documents"
_CACHE_KEYS = ("past_key_values", "cache_params", "cache")


def documents_from_position_ids(position_ids: torch.Tensor) -> PackedSeqParams | None:
    """The documents of ``position_ids [B, T]`` (or ``[T]``) where they restart (an id that does not
    continue the previous one by 1); None for one document per row. ValueError for rows of different
    layouts."""
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    if pos.shape[-1] < 2:
        return None
    restarts = pos[:, 1:] - pos[:, :-1] != 1  # [B, T-1]
    if not bool(restarts.any()):
        return None
    if not bool((restarts == restarts[:1]).all()):
        raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} restart at different tokens in different "
                         "rows, but one document layout serves the batch; pass packed_seq_params (or one row per call) "
                         "so the recurrent mixers reset where the attention does.")
    starts = torch.nonzero(restarts[0]).flatten().to(torch.int32) + 1
    ends = torch.tensor([0, pos.shape[-1]], dtype=torch.int32, device=starts.device)
    return PackedSeqParams.from_cu_seqlens(torch.cat([ends[:1], starts, ends[1:]]))


def _add_documents(module: nn.Module, args: tuple, kwargs: dict):
    if kwargs.get("packed_seq_params") is not None or kwargs.get("position_ids") is None:
        return None
    if any(kwargs.get(key) is not None for key in _CACHE_KEYS):
        return None
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        return None
    packed = documents_from_position_ids(kwargs["position_ids"])
    if packed is None:
        return None
    return args, {**kwargs, "packed_seq_params": packed}


def use_position_documents(model: nn.Module) -> None:
    """Register the pre-hook of the module docstring on ``model`` and its ``base_model`` (idempotent)."""
    for module in {id(m): m for m in (model, getattr(model, "base_model", model))}.values():
        if not getattr(module, _HOOKED, False):
            module.register_forward_pre_hook(_add_documents, with_kwargs=True)
            setattr(module, _HOOKED, True)
