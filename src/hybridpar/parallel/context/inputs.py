"""Input sharding for context and sequence parallelism with explicit process groups.

The contract of Megatron MIMO's ``PartitionAdapter.shard`` (seed ``001_*``), for a rank at
``(cp_rank, tp_rank)`` of a language model's own grid:

- token ids and embeddings: DualChunkSwap ("zigzag") over CP along ``seq_dim``; then, only
  for embeddings and only with ``sequence_parallel``, a contiguous split over the TP group:
  ``[S, B, H] -> [S/cp, B, H] -> [S/(cp*tp), B, H]`` (``seq_dim=0``) or the batch-first
  ``[B, S, H] -> [B, S/(cp*tp), H]`` (``seq_dim=1``). Token ids are never SP-split (the
  vocab-parallel embedding reduce-scatters its own output).
- labels, loss mask and position ids (always batch-first ``[B, S]``): CP zigzag only.
- ``PackedSeqParams``: this rank's view (``zigzag.localize``); a dense batch under CP gets
  ``PackedSeqParams.for_dense(S)`` so every CP layer has a layout.

Every rank holds the full batch, so sharding is slicing: no communication, and every rule
is checked before anything is sliced. ``gather_outputs`` is the inverse for outputs and
does communicate (autograd-aware all-gathers over the SP group, then the CP group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from hybridpar.data.thd import PackedSeqParams
from hybridpar.parallel.comm.collectives import all_gather
from hybridpar.parallel.context.zigzag import localize, validate_zigzag_lengths

__all__ = ["ShardedInputs", "shard_inputs", "gather_outputs", "group_size_and_rank"]


@dataclass
class ShardedInputs:
    """This rank's inputs; ``None`` wherever the caller passed ``None``.

    ``attention_mask`` is passed through unchanged and can only be set without CP.
    """

    input_ids: Tensor | None
    inputs_embeds: Tensor | None
    labels: Tensor | None
    loss_mask: Tensor | None
    position_ids: Tensor | None
    packed: PackedSeqParams | None
    attention_mask: Tensor | None = None

    def global_positions(self) -> Tensor | None:
        """``[S_local]``: the position in the full row of each token this rank holds (CP: zigzag)."""
        if self.packed is not None and self.packed.cp is not None:
            return self.packed.cp.local_indices
        for x in (self.labels, self.loss_mask, self.position_ids):  # batch-first [B, S] whatever seq_dim was
            if x is not None:
                return torch.arange(x.shape[1], dtype=torch.int64)
        return None


def group_size_and_rank(group: dist.ProcessGroup | None, name: str) -> tuple[int, int]:
    """``(size, rank)`` of this process in ``group``; ``None`` means a group of one."""
    if group is None:
        return 1, 0
    if not isinstance(group, dist.ProcessGroup) and group != dist.GroupMember.NON_GROUP_MEMBER:  # (not a member: below)
        raise ValueError(f"{name} must be a torch.distributed ProcessGroup or None, got {type(group).__name__}; pass "
                         f"the mesh dimension's group, e.g. mesh['{name.removesuffix('_group')}'].get_group().")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of {name} (size {size}); "
            f"pass the {name} this rank belongs to, or None on ranks outside the language model's grid."
        )
    return size, rank


def _seq_and_batch(name: str, x: Tensor, seq_dim: int, min_dim: int) -> tuple[int, int]:
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(x.shape)}.")
    return x.shape[seq_dim], x.shape[1 - seq_dim]


def _check_sizes(sizes: dict[str, tuple[int, int]]) -> tuple[int | None, int | None]:
    """All tensors must agree on S; on B too, except a broadcast batch of 1 (position ids)."""
    seqs = {n: s for n, (s, _) in sizes.items()}
    if len(set(seqs.values())) > 1:
        raise ValueError(f"sequence lengths disagree: {seqs}; every input must cover the same S tokens.")
    batches = {n: b for n, (_, b) in sizes.items() if not (n == "position_ids" and b == 1)}
    if len(set(batches.values())) > 1:
        raise ValueError(f"batch sizes disagree: {batches}; every input must hold the same B rows.")
    seq_len = next(iter(seqs.values()), None)
    return seq_len, next(iter(batches.values()), None)


def shard_inputs(
    input_ids: Tensor | None = None,
    inputs_embeds: Tensor | None = None,
    labels: Tensor | None = None,
    loss_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    packed: PackedSeqParams | None = None,
    attention_mask: Tensor | None = None,
    *,
    cp_group: dist.ProcessGroup | None = None,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    seq_dim: int = 1,
) -> ShardedInputs:
    """Slice one full batch down to this rank's part (see module docstring); no communication.

    ``input_ids`` ``[B, S]`` / ``inputs_embeds`` ``[B, S, H]`` follow ``seq_dim`` (0 means
    ``[S, B]`` / ``[S, B, H]``); ``labels``, ``loss_mask``, ``position_ids`` are ``[B, S]``
    (position ids may be ``[1, S]``). ``packed`` is the global layout of the row(s).
    """
    if seq_dim not in (0, 1):
        raise ValueError(
            f"seq_dim must be 0 (sequence-first [S, B, ...]) or 1 (batch-first [B, S, ...]), got {seq_dim!r:.40}."
        )
    tensors = dict(input_ids=input_ids, inputs_embeds=inputs_embeds, labels=labels, loss_mask=loss_mask,
                   position_ids=position_ids, attention_mask=attention_mask)
    for name, value in tensors.items():
        if value is not None and not isinstance(value, Tensor):
            raise ValueError(f"shard_inputs: {name} must be a torch.Tensor or None, got {type(value).__name__}; "
                             "pass the batch's tensors (torch.as_tensor for a list).")
    if packed is not None and not isinstance(packed, PackedSeqParams):
        raise ValueError(f"shard_inputs: packed must be a PackedSeqParams or None, got {type(packed).__name__}; build "
                         "it with PackedSeqParams.from_cu_seqlens(cu_seqlens).")
    cp_size, cp_rank = group_size_and_rank(cp_group, "cp_group")
    tp_size, tp_rank = group_size_and_rank(tp_group, "tp_group")
    if attention_mask is not None and cp_size > 1:
        raise ValueError(
            f"a dense attention_mask of shape {tuple(attention_mask.shape)} was given with context parallel "
            f"size {cp_size}: a dense mask cannot follow the zigzag token layout. Drop it and use causal "
            "masking, or describe documents and padding with packed (PackedSeqParams from cu_seqlens)."
        )
    sizes: dict[str, tuple[int, int]] = {}
    if input_ids is not None:
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be 2-D ([B, S], or [S, B] with seq_dim=0), got shape {tuple(input_ids.shape)}."
            )
        sizes["input_ids"] = _seq_and_batch("input_ids", input_ids, seq_dim, 2)
    if inputs_embeds is not None:
        sizes["inputs_embeds"] = _seq_and_batch("inputs_embeds", inputs_embeds, seq_dim, 3)
    for name, x in (("labels", labels), ("loss_mask", loss_mask), ("position_ids", position_ids)):
        if x is not None:
            if x.dim() != 2:
                raise ValueError(
                    f"{name} must be batch-first 2-D [B, S] (whatever seq_dim is), got shape {tuple(x.shape)}."
                )
            sizes[name] = _seq_and_batch(name, x, 1, 2)
    seq_len, _ = _check_sizes(sizes)
    if packed is not None:
        if packed.cp is not None:
            raise ValueError(
                f"packed params are already localized (cp_size={packed.cp.cp_size}, cp_rank={packed.cp.cp_rank}); "
                "pass the global PackedSeqParams of the batch."
            )
        if seq_len is not None and packed.total_tokens != seq_len:
            raise ValueError(
                f"packed params describe {packed.total_tokens} tokens (cu_seqlens_padded[-1]) but the inputs have "
                f"S = {seq_len} ({', '.join(sizes)}); " + ("the params of a collated batch describe its rows as one: "
                "pass input_ids.reshape(1, -1) and labels.reshape(1, -1)." if packed.total_tokens % seq_len == 0 and
                packed.total_tokens > seq_len else "build the params from the same packed row.")
            )
        seq_len = packed.total_tokens
    if seq_len is None:
        return ShardedInputs(None, None, None, None, None, None, attention_mask)

    if cp_size > 1:  # per-document (packed) or whole-sequence (dense) divisibility by 2*cp
        validate_zigzag_lengths(packed.cu_seqlens_padded if packed is not None else seq_len, cp_size)
    local_len = seq_len // cp_size
    if sequence_parallel and local_len % tp_size != 0:
        need = 2 * cp_size * tp_size if cp_size > 1 else tp_size
        raise ValueError(
            f"sequence length {seq_len} gives {local_len} tokens per context-parallel rank (cp={cp_size}), "
            f"which sequence parallel cannot split evenly over the TP group of size {tp_size}; pad S to a "
            f"multiple of {need} (packed: extend the last document's padding so S/cp is a multiple of {tp_size})."
        )

    local_packed = packed
    idx = None
    if cp_size > 1:
        local_packed = localize(packed if packed is not None else PackedSeqParams.for_dense(seq_len), cp_size, cp_rank)
        idx = local_packed.cp.local_indices  # [S/cp], global token of each local token

    def cp_shard(x: Tensor | None, dim: int) -> Tensor | None:
        if x is None or idx is None:
            return x
        return x.index_select(dim, idx.to(x.device))  # [.., S, ..] -> [.., S/cp, ..] along dim

    embeds = cp_shard(inputs_embeds, seq_dim)
    if embeds is not None and sequence_parallel and tp_size > 1:
        n = local_len // tp_size
        embeds = embeds.narrow(seq_dim, tp_rank * n, n).contiguous()  # [S/cp, B, H] -> [S/(cp*tp), B, H]
    return ShardedInputs(
        input_ids=cp_shard(input_ids, seq_dim),
        inputs_embeds=embeds,
        labels=cp_shard(labels, 1),
        loss_mask=cp_shard(loss_mask, 1),
        position_ids=cp_shard(position_ids, 1),
        packed=local_packed,
        attention_mask=attention_mask,
    )


def gather_outputs(
    local: Tensor,
    packed: PackedSeqParams | None,
    cp_group: dist.ProcessGroup | None,
    seq_dim: int = 1,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
) -> Tensor:
    """Put a rank-local output back into global sequence order, on every rank.

    ``local`` is ``[B, S/cp, ...]`` (``[B, S/(cp*tp), ...]`` with ``sequence_parallel``), or
    sequence-first with ``seq_dim=0``; ``packed`` is this rank's view from ``shard_inputs``.
    Backward reduce-scatters: if every rank computes the same loss from the result, gradients
    are summed over the SP and CP groups (scale that loss by ``1/(cp*tp)``).
    """
    if seq_dim < 0 or seq_dim >= local.dim():
        raise ValueError(f"seq_dim {seq_dim} is out of range for an output of shape {tuple(local.shape)}.")
    cp_size, cp_rank = group_size_and_rank(cp_group, "cp_group")
    tp_size, _ = group_size_and_rank(tp_group, "tp_group")
    sp_size = tp_size if sequence_parallel else 1
    layout = packed.cp if packed is not None else None
    layout_cp = layout.cp_size if layout is not None else 1
    if layout_cp != cp_size or (layout is not None and layout.cp_rank != cp_rank):
        got = "no layout" if layout is None else f"cp_size={layout.cp_size}, cp_rank={layout.cp_rank}"
        raise ValueError(
            f"packed params carry {got} but cp_group has size {cp_size} and this rank is {cp_rank}; pass the "
            "packed params shard_inputs returned for the same cp_group."
        )
    if layout is not None:
        expected = layout.local_indices.numel()
    else:
        expected = packed.total_tokens if packed is not None else local.shape[seq_dim] * sp_size
    if local.shape[seq_dim] * sp_size != expected:
        raise ValueError(
            f"output has {local.shape[seq_dim]} tokens along seq_dim {seq_dim} (shape {tuple(local.shape)}); with "
            f"sequence-parallel size {sp_size} this rank should hold {expected} tokens in total; check seq_dim, "
            "sequence_parallel and tp_group."
        )
    x = local
    if sp_size > 1:
        x = all_gather(x, tp_group, seq_dim)  # [B, S/(cp*tp), ...] -> [B, S/cp, ...]
    if cp_size > 1:
        x = all_gather(x, cp_group, seq_dim)  # [B, S/cp, ...] -> [B, S, ...], rank-major order
        x = x.index_select(seq_dim, layout.gathered_to_sequence.to(x.device))  # -> sequence order
    return x
