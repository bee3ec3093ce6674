"""Activation checkpointing of a model's blocks: ``none``, ``full`` or ``selective``.

- ``full``: each block runs in a non-reentrant checkpoint; it keeps only its input and the
  backward recomputes the whole block.
- ``selective``: the same checkpoint with torch's selective-checkpoint contexts. Outputs of
  matrix multiplies (``aten.mm``/``addmm``: the projections in_proj, q/k/v, MLP up/gate) and of
  attention kernels (torch's fused SDPA kernels and hybridpar's own ``hybridpar::*`` kernels,
  e.g. an attention core) are kept; norms, activations, RoPE and the Mamba conv + scan (the
  ``hybridpar::ssd_chunk_scan`` op, which recomputes its own internals anyway) are recomputed.
  A block's last matmul (out_proj, o_proj, down_proj) is not kept: its output only enters the
  residual sum, which backward never reads, and the recomputation stops (checkpoint early stop)
  once the tensors backward needs exist, before that matmul runs. The policy learns which
  matmul is last from the block's previous forward (the first step keeps all of them).

Any policy gives the same gradients (the recomputation is exact: no randomness in blocks); they
trade memory for recomputation. Bytes kept per token, per block kind and policy:
``python benchmarks/long_context.py --section saved``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["POLICIES", "checkpointing_policy", "apply_activation_checkpointing"]

POLICIES = ("none", "full", "selective")
BLOCK_CONTAINERS = ("model.layers", "backbone.layers", "layers")
_aten = torch.ops.aten
MATMULS = {_aten.mm.default, _aten.addmm.default}
ATTENTION_KERNELS = {
    getattr(_aten, name).default
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(_aten, name)
}
RECOMPUTED_KERNELS = {"ssd_chunk_scan"}  # hybridpar ops selective recomputes (names in the hybridpar namespace)


def checkpointing_policy(value) -> str:
    """``"none" | "full" | "selective"`` from a policy name or the old booleans (True: full)."""
    if isinstance(value, bool):
        return "full" if value else "none"
    if value not in POLICIES:
        raise ValueError(f"activation_checkpointing={value!r} is not a policy; choose one of {list(POLICIES)} "
                         "(true/false mean full/none).")
    return value


class _SelectivePolicy:
    """``context_fn`` of one checkpointed block: a fresh pair of selective-checkpoint contexts per
    forward, keeping matmul and attention-kernel outputs except the block's last matmul."""

    def __init__(self):
        self.matmuls_per_forward: int | None = None  # known after the block's first forward
        self._counted = 0  # matmuls seen by the latest forward

    def __call__(self):
        if self._counted:
            self.matmuls_per_forward = self._counted
        self._counted = 0
        last = self.matmuls_per_forward  # the forward and its recomputation must decide alike
        seen = {False: 0, True: 0}

        def policy(ctx, op, *args, **kwargs):
            if op in MATMULS:
                seen[ctx.is_recompute] += 1
                if not ctx.is_recompute:
                    self._counted = seen[False]
                keep = last is None or seen[ctx.is_recompute] != last
                return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
            if op in ATTENTION_KERNELS or (getattr(op, "namespace", None) == "hybridpar"
                                           and op._opname not in RECOMPUTED_KERNELS):
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: nn.Module, policy: str | bool = "full") -> nn.Module:
    """Wrap every block (``model.layers`` / ``backbone.layers`` / ``layers``) in a non-reentrant
    checkpoint of the given policy (``none`` leaves the model as it is); returns ``model``."""
    policy = checkpointing_policy(policy)
    if policy == "none":
        return model
    layers = model_blocks(model, "activation checkpointing", "Set activation_checkpointing='none'.")
    for index, block in enumerate(layers):
        options = {} if policy == "full" else {"context_fn": _SelectivePolicy()}
        layers[index] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **options)
    return model


def model_blocks(model: nn.Module, what: str, fix: str) -> nn.ModuleList | nn.Sequential:
    """The module list of blocks (``model.layers`` / ``backbone.layers`` / ``layers``) that ``what``
    works on; a ``ValueError`` ending in ``fix`` when the model has none."""
    for path in BLOCK_CONTAINERS:
        try:
            layers = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(layers, (nn.ModuleList, nn.Sequential)):
            return layers
    raise ValueError(f"{type(model).__name__} has none of {list(BLOCK_CONTAINERS)} as a module list of blocks; "
                     f"{what} works on those. {fix}")
