"""Activation checkpointing of a model's blocks: ``none``, ``full`` or ``selective``.

- ``full``: each block runs in a non-reentrant checkpoint; it keeps only its input and the
  backward recomputes the whole block.
- ``selective``: the same checkpoint with torch's selective-checkpoint contexts, keeping what the
  block's *sequence mixer* reads and returns and recomputing everything token-local:

  * kept: the outputs of the matrix multiplies (``aten.mm``/``addmm``) that run before the
    block's last sequence-mixing kernel (attention kernel, ``hybridpar::*`` op, or the
    ``aten.bmm`` score products of an eager attention core) -- the projections into it
    (Mamba2 ``in_proj``; attention ``q/k/v``) -- and the outputs of attention kernels (torch's
    fused SDPA kernels and varlen flash attention, hybridpar's ``hybridpar::*`` attention ops);
  * recomputed: norms, activations, RoPE, the Mamba conv + scan (``hybridpar::ssd_chunk_scan``
    or, on CUDA, ``hybridpar::fused_conv_scan``: their backward recomputes their internals
    anyway), and every matmul after the last mixing kernel: ``out_proj``/``o_proj`` (their
    output only enters the residual sum, which backward never reads: the recomputation stops
    (checkpoint early stop) before they run) and a whole MLP block's ``up``/``gate`` (an MLP
    block has no mixing kernel, so it keeps only its input).

  Why the MLP's projection goes: every projection from the hidden size costs ``2 D`` flops per
  output element to recompute, so what matters is the bytes it frees. At ``nemotronh-8b``
  widths (float32, KiB per token; ``benchmarks/results/long_context_saved.md``):

  | block | none | selective | kept by selective |
  | --- | ---: | ---: | --- |
  | Mamba2 | 168.5 | 88.5 | input 16, ``in_proj`` output ``[z, xBC, dt]`` 72.5 (the scan and the gated norm read it) |
  | MLP | 200 | 16 | input 16 (``up``: 84, recomputed: one matmul) |
  | attention | 72.1 | 40.0 | input 16, q 16, k 4, v 4 |

  The eager blockwise attention core (CPU) is an ``autograd.Function`` whose ops the policy
  sees one by one, so its output is recomputed; torch's fused SDPA kernels and the compiled
  core (``hybridpar::blockwise_attention_fwd``) keep theirs (+16 KiB per token, log-sum-exp).
  Whole model 0.29x of ``none`` (keeping the MLP's ``up`` too would be 0.51x). The policy
  learns which matmuls precede the last mixing kernel from the block's previous forward (the
  first forward keeps every matmul).

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
# hybridpar ops selective recomputes (names in the hybridpar namespace): the Mamba conv + scan, pure or fused
RECOMPUTED_KERNELS = {"ssd_chunk_scan", "fused_conv_scan"}
KERNEL_NAMESPACES = ("hybridpar", "torch_attn")  # hybridpar's opaque ops; torch's varlen flash attention


def checkpointing_policy(value) -> str:
    """``"none" | "full" | "selective"`` from a policy name or the old booleans (True: full)."""
    if isinstance(value, bool):
        return "full" if value else "none"
    if value not in POLICIES:
        raise ValueError(f"activation_checkpointing={value!r} is not a policy; choose one of {list(POLICIES)} "
                         "(true/false mean full/none).")
    return value


def _is_mixing_kernel(op) -> bool:
    """A sequence-mixing kernel: an attention kernel, a hybridpar op (attention core, SSD scan) or
    a batched matmul (``aten.bmm``: the score and value products of an eager attention core,
    e.g. hybridpar's blockwise core, whose ``autograd.Function`` runs its ops in the open)."""
    return op in ATTENTION_KERNELS or op is _aten.bmm.default or getattr(op, "namespace", None) in KERNEL_NAMESPACES


def _kept_kernel_output(op) -> bool:
    """Attention kernels (torch's varlen flash attention included) and hybridpar's opaque ops keep
    their outputs; the Mamba conv + scan (its backward recomputes its internals anyway) and bmm
    (``[B, H, S_q, S_k]`` blocks) do not."""
    opaque = getattr(op, "namespace", None) in KERNEL_NAMESPACES
    return op in ATTENTION_KERNELS or (opaque and op._opname not in RECOMPUTED_KERNELS)


class _SelectivePolicy:
    """The selective policy of one kind of block: a fresh pair of selective-checkpoint contexts per
    forward, keeping the matmul outputs before the block's last mixing kernel and the attention
    kernels' outputs. Blocks of a kind share it (the same ops in the same order); ``learned`` says
    whether a forward has taught it the count, which ``torch.compile`` needs before it traces
    (``apply_compile`` compiles such a block after its first forward)."""

    def __init__(self):
        self.kept_matmuls: int | None = None  # matmuls before the last mixing kernel (None: keep all)
        self._seen: int | None = None  # that count in the latest forward (None: no forward yet)

    def __call__(self):
        if self._seen is not None:
            self.kept_matmuls = self._seen
        self._seen = 0
        kept = self.kept_matmuls  # the forward and its recomputation must decide alike
        matmuls = {False: 0, True: 0}

        def policy(ctx, op, *args, **kwargs):
            if op in MATMULS:
                matmuls[ctx.is_recompute] += 1
                keep = kept is None or matmuls[ctx.is_recompute] <= kept
                return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
            if _is_mixing_kernel(op):
                if not ctx.is_recompute:
                    self._seen = matmuls[False]
                if _kept_kernel_output(op):
                    return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    @property
    def learned(self) -> bool:
        return self._seen is not None


def apply_activation_checkpointing(model: nn.Module, policy: str | bool = "full") -> nn.Module:
    """Wrap every block (``model.layers`` / ``backbone.layers`` / ``layers`` / ``find_blocks``) in a non-reentrant
    checkpoint of the given policy (``none`` leaves the model as it is); returns ``model``."""
    policy = checkpointing_policy(policy)
    if policy == "none":
        return model
    layers = model_blocks(model, "activation checkpointing", "Set activation_checkpointing='none'.")
    context_fns: dict[tuple, object] = {}
    for index, block in enumerate(layers):
        options = {}
        if policy == "selective":
            kind = tuple(type(m) for m in block.modules())
            options["context_fn"] = context_fns.setdefault(kind, _context_fn(_SelectivePolicy()))
        layers[index] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **options)
    return model


def _context_fn(policy: _SelectivePolicy):
    """A plain function for ``checkpoint(context_fn=...)`` (dynamo takes functions, not callable
    objects), one per kind of block: blocks of a kind share it, and with it their compiled graph."""
    def context_fn():
        return policy()

    context_fn.policy = policy
    return context_fn


def selective_policy(block: nn.Module) -> _SelectivePolicy | None:
    """The selective policy a checkpointed block runs under, or None."""
    fn = getattr(block, "checkpoint_fn", None)
    context_fn = getattr(fn, "keywords", {}).get("context_fn")
    return getattr(context_fn, "policy", None)


def find_blocks(model: nn.Module) -> nn.ModuleList | nn.Sequential | None:
    """The module list of blocks: ``model.layers`` / ``backbone.layers`` / ``layers``, else the list
    whose modules are all of the classes a transformers model names in ``_no_split_modules`` (its
    decoder blocks: GPT-2's ``transformer.h``, GPT-NeoX's ``gpt_neox.layers``); None if neither."""
    for path in BLOCK_CONTAINERS:
        try:
            layers = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(layers, (nn.ModuleList, nn.Sequential)):
            return layers
    names = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) and \
                all(type(block).__name__ in names for block in module):
            return module
    return None


def model_blocks(model: nn.Module, what: str, fix: str) -> nn.ModuleList | nn.Sequential:
    """The module list of blocks (``find_blocks``) that ``what`` works on; a ``ValueError`` ending in
    ``fix`` when the model has none."""
    layers = find_blocks(model)
    if layers is not None:
        return layers
    raise ValueError(f"{type(model).__name__} has none of {list(BLOCK_CONTAINERS)} as a module list of blocks; "
                     f"{what} works on those. {fix}")
