"""The inputs of a transformers model under hybridpar's attention: the ``PackedSeqParams`` of
position ids that restart at every document, and the forward kwargs of this rank's shard
(``hf_cp_inputs``), re-exported by ``context/hf.py``."""

from __future__ import annotations

import torch
from torch import Tensor

from hybridpar.data.thd import PackedSeqParams
from hybridpar.parallel.context.inputs import ShardedInputs

__all__ = ["hf_cp_inputs", "packed_from_position_ids"]


def packed_from_position_ids(position_ids: Tensor) -> PackedSeqParams:
    """The ``PackedSeqParams`` of rows whose position ids restart at 0 at every document start.

    ``position_ids`` ``[S]`` or ``[B, S]`` (every row the same layout: one ``PackedSeqParams`` is
    shared by the batch); each document must count ``0, 1, 2, ...``. Build it from the global
    batch and pass it to ``shard_inputs(..., packed=...)`` (one host sync).
    """
    pos = position_ids.reshape(-1, position_ids.shape[-1]).long().cpu()
    if pos.shape[-1] == 0 or not bool((pos == pos[:1]).all()):
        raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} must be non-empty and equal on every "
                         "row (one document layout per batch); pack rows with one layout or use one row.")
    row = pos[0]
    starts = torch.nonzero(row == 0).flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError(f"position_ids must start at 0 (a document start), got {row[:8].tolist()}...; build them per "
                         "document, restarting at 0.")
    cu = torch.cat([starts, torch.tensor([row.numel()])]).to(torch.int32)
    packed = PackedSeqParams.from_cu_seqlens(cu)
    if not torch.equal(packed.position_ids[0], row):
        bad = int(torch.nonzero(packed.position_ids[0] != row)[0])
        raise ValueError(f"position_ids must count 0, 1, 2, ... inside every document; token {bad} has "
                         f"{int(row[bad])}, expected {int(packed.position_ids[0, bad])}.")
    return packed


def hf_cp_inputs(sharded: ShardedInputs) -> dict:
    """The forward kwargs of a transformers model for this rank's ``shard_inputs`` result.

    Returns ``input_ids`` (or ``inputs_embeds``) ``[B, S/cp]``, ``position_ids [B, S/cp]`` (this
    rank's tokens' positions in their documents: ``sharded.position_ids`` if given, else
    ``packed.position_ids``; these drive RoPE), ``packed_seq_params`` (the localized layout the
    attention reads; omitted when there is none), ``attention_mask`` only when given (cp=1), and
    ``use_cache=False``. Labels are not included: compute the loss from the logits or with
    ``hf_causal_lm_loss(model, labels=sharded.labels, **hf_cp_inputs(sharded), ...)``.
    """
    tokens = sharded.input_ids if sharded.input_ids is not None else sharded.inputs_embeds
    if tokens is None:
        raise ValueError("hf_cp_inputs needs sharded input_ids or inputs_embeds; pass them to shard_inputs.")
    inputs = {"input_ids": sharded.input_ids} if sharded.input_ids is not None else {
        "inputs_embeds": sharded.inputs_embeds}
    positions = sharded.position_ids
    if positions is None and sharded.packed is not None:
        positions = sharded.packed.position_ids.to(tokens.device).expand(tokens.shape[0], -1)  # [B, S/cp]
    if positions is not None:
        inputs["position_ids"] = positions
    if sharded.packed is not None:
        inputs["packed_seq_params"] = sharded.packed
    if sharded.attention_mask is not None:
        inputs["attention_mask"] = sharded.attention_mask
    inputs["use_cache"] = False
    return inputs
