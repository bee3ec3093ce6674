"""What the attention CP strategies share: input checks, block sizes, the group-of-one path.

A strategy (``context/attention.py``: "allgather", "ulysses"; ``context/ring.py``: "ring") is called as
``core(q, k, v, packed, scale=None, sliding_window=None, softcap=None)`` with this rank's
``q [B, S/P, Hq, Dh]``, ``k, v [B, S/P, Hkv, Dh]`` and localized ``PackedSeqParams``; ``scale``
(default ``1/sqrt(Dh)``), ``sliding_window`` (keys fewer than ``W`` global positions back) and
``softcap`` (scores ``c * tanh(S / c)``) and ``sinks`` (GPT-OSS's ``[Hq]`` logits) are the core's own options, which Hugging Face attention modules pass (``context/hf.py``).
Everything here is checked without communication, so bad input raises the same
``ValueError`` on every rank before any collective.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from hybridpar.data.thd import ContextParallelLayout, PackedSeqParams
from hybridpar.models.attention.mixer import sequence_layout
from hybridpar.models.attention.kernels import attention_core
from hybridpar.models.attention.layout import AttentionLayout, cached, check_block_sizes, check_sliding_window
from hybridpar.models.attention.blockwise import BLOCK_SIZE, KEYS_PER_STEP, check_softcap
from hybridpar.models.attention.sinks import check_sinks
from hybridpar.parallel.context.core import ContextParallelCore

__all__ = ["AttentionStrategy", "global_sequence_layout"]


class AttentionStrategy(ContextParallelCore):
    """Base of the attention strategies: head and shape checks, the core's block sizes."""

    def __init__(self, cp_group: dist.ProcessGroup | None, block_size: int = BLOCK_SIZE,
                 keys_per_step: int = KEYS_PER_STEP):
        check_block_sizes(block_size, keys_per_step)
        super().__init__(cp_group)
        self.core_options = dict(block_size=block_size, keys_per_step=keys_per_step)

    def validate_heads(self, num_heads: int, num_kv_heads: int) -> None:
        """Raise ``ValueError`` if this strategy cannot run these (rank-local) head counts."""
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(
                f"query heads {num_heads} must be a positive multiple of kv heads {num_kv_heads} (grouped-query attention)."
            )

    def _check_qkv(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
            raise ValueError(
                f"{self.name} attention expects q [B, S/cp, Hq, Dh] and k, v [B, S/cp, Hkv, Dh], got q "
                f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}."
            )
        self.validate_heads(q.shape[2], k.shape[2])

    def _layout_or_none(self, q: Tensor, k: Tensor, v: Tensor, packed: PackedSeqParams | None):
        """Checked inputs and this rank's layout; None on a group of one (single-process attention)."""
        self._check_qkv(q, k, v)
        if self.cp_size > 1:
            return self.checked_layout(packed, q.shape[1])
        if packed is not None and packed.cp is not None:
            self.checked_layout(packed, q.shape[1], cp_size=1, cp_rank=0)
        return None

    def call_options(self, scale: float | None, sliding_window: int | None, softcap: float | None = None,
                     sinks: Tensor | None = None, num_heads: int = 0) -> dict:
        """The core's keyword arguments for one call: block sizes, ``scale`` (None: ``1/sqrt(Dh)``), window,
        logit soft-capping, attention sinks ``[Hq]`` of the ``num_heads`` local query heads (None: none)."""
        check_sliding_window(sliding_window)
        check_softcap(softcap)
        if sinks is not None:
            check_sinks(sinks, num_heads, f"{self.name} attention")
        return dict(self.core_options, scale=scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks)

    def _single_process(self, q: Tensor, k: Tensor, v: Tensor, packed: PackedSeqParams | None,
                        options: dict | None = None) -> Tensor:
        options = self.core_options if options is None else options
        return attention_core(q, k, v, sequence_layout(packed, q.shape[1], q.device), **options)


def global_sequence_layout(packed: PackedSeqParams, layout: ContextParallelLayout, device) -> AttentionLayout:
    """All ``S`` tokens in sequence order: positions ``0..S-1``, documents ``cp.global_seq_idx``."""
    return cached(packed.cache, ("attention.global_sequence", str(device)), lambda: AttentionLayout.sequence(
        layout.global_seq_idx[0].to(device), packed.cu_seqlens_padded.to(device), packed.max_seqlen))
