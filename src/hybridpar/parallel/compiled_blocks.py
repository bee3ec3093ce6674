"""``torch.compile`` per block: ``apply_compile`` and the options ``parallelize(compile=...)`` takes.

Each block is compiled in place (``Module.compile``: parameter names do not change), after TP, CP
and activation checkpointing and before FSDP (torchtitan's order), so the TP hooks, the CP core
calls and the ``PackedSeqParams`` reads are inside the graph. Blocks of a kind share their graphs
(forward and, through AOT autograd, backward). Four things would stop that or break it, and are
handled here:

- **Hook ids.** A module's ``_call_impl`` asks whether each forward hook's id is among its
  ``always_call`` hooks, and dynamo guards on that id. Ids come from one global counter, so every
  block's TP hooks (registered ``always_call=True`` to restore the parameters they swap even if the
  forward raises) failed the previous block's guard: one graph per block, and past dynamo's
  recompile limit the remaining blocks ran eagerly. Under compile the flag is dropped (the hooks
  still run on every forward that returns); 12 blocks at cp=2 x tp=2 then compile 7 graphs, not 11.
  A checkpointed block then recomputes to its end (``early_stop=False``): torch's early stop raises
  out of the recomputed forward once the saved tensors are back, which skipped those hooks, and a
  TP style's shards swapped in for one forward (Mamba2 mixers, grouped experts) were left in place
  of the parameters, which then had no gradient.
- **Swaps inside a checkpoint.** Those TP hooks put a shard in a module's parameter dict and take
  it out again within one forward. Dynamo would replay such a mutation in the recomputation, cannot,
  and so broke the graph at every checkpointed block that held one (2 breaks at tp=2; the block
  ran eagerly). The swaps leave nothing to replay, so dynamo is told to skip it
  (``skip_fwd_side_effects_in_bwd_under_checkpoint``): no break, and float64 steps equal one process's.
- **View inputs.** When a compiled region's input is a view of a DTensor's local tensor (the output
  of ``to_local()``, e.g. a vocab-parallel embedding's at tp > 1 without sequence parallelism), AOT
  autograd's backward hands DTensor's ``Redistribute`` a plain tensor and raises
  ``AttributeError: 'Tensor' object has no attribute '_local_tensor'`` (torch 2.13, seen with
  aot_eager, whose AOT autograd inductor shares). A block gets such an input as its own tensor (one
  copy of ``[B, S, D]``, the first block's input only).
- **Sizes under TP.** A TP block that met a second hidden-state shape (``[2, 32]`` then ``[1, 64]``)
  failed to recompile with dynamic sizes (``RecursionError`` in AOT autograd's trace of the DTensor
  ops, torch 2.13). Under TP a block's inputs of two or more dims are marked static, so a new shape
  compiles a new graph; the 1-D document-boundary tensors stay dynamic, so new documents do not.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hybridpar.models.attention.kernels import varlen_kernel
from hybridpar.models.linear.gdn_fused import fla_rule
from hybridpar.models.linear.kda_fused import fla_kda
from hybridpar.models.mamba.fused_op import fla_gated_backward_refusal, fla_scan
from hybridpar.parallel.checkpointing import model_blocks, selective_policy

__all__ = ["apply_compile", "compile_options", "restore_dynamo_settings"]


def compile_options(compile) -> dict:
    """``torch.compile`` options of ``parallelize``'s ``compile``: True, a backend name or a dict."""
    options = {"backend": compile} if isinstance(compile, str) else compile if isinstance(compile, dict) else {}
    if not isinstance(compile, (bool, str, dict)):
        raise ValueError(f"compile={compile!r} must be a bool, a torch.compile backend name or a dict of "
                         "torch.compile options, e.g. {'backend': 'aot_eager'}.")
    backend = options.get("backend", "inductor")
    known = torch._dynamo.list_backends(exclude_tags=())
    if isinstance(backend, str) and backend not in known:
        raise ValueError(f"compile backend {backend!r} is unknown; use one of {sorted(known)} (true means 'inductor').")
    return options


def apply_compile(model: nn.Module, **options) -> nn.Module:
    """``torch.compile`` every block in place (``Module.compile(**options)``, e.g. ``backend="aot_eager"``).

    A kind is compiled for training and for evaluation (grad mode), each first for the first
    batch's sizes and again as sizes turn dynamic, so dynamo's recompile limit (per code object,
    shared by all blocks) is raised to 8 per kind. A block under selective checkpointing compiles
    after the training forward that teaches its policy what to keep. Apply after TP, CP and
    activation checkpointing, before FSDP.
    """
    blocks = model_blocks(model, "compile", "Set compile=False.")
    if torch.cuda.is_available():
        fla_scan()  # resolved before tracing: dynamo reads the fused scan's availability as a constant
        fla_rule()  # the same for the gated delta rule (models/linear/gdn_fused.py)
        fla_kda()  # and for Kimi Delta Attention (models/linear/kda_fused.py)
        fla_gated_backward_refusal()  # and whether FLA's gated backward runs on this GPU
        varlen_kernel()  # and torch's varlen attention and its signature
    kinds = {tuple(type(m) for m in block.modules()) for block in blocks}
    if any(selective_policy(block) is not None for block in blocks):  # dynamo's advice on a selective context_fn
        # printed its 4 raw log lines per rank ("make sure the checkpointed region does not contain in-place ops");
        # the selective policy is hybridpar's, held to one process by the checks: only its errors are shown
        logging.getLogger("torch._higher_order_ops.wrap").setLevel(logging.ERROR)
    _set_dynamo("recompile_limit", max(torch._dynamo.config.recompile_limit, 8 * len(kinds)))
    if any(isinstance(getattr(block, "checkpoint_fn", None), functools.partial) for block in blocks):
        _set_dynamo("skip_fwd_side_effects_in_bwd_under_checkpoint", True)  # the swaps (module docstring)
    for block in blocks:
        for module in block.modules():  # the hook-id guards (module docstring)
            module._forward_hooks_always_called.clear()
        _recompute_to_the_end(block)
        static_sizes = any(isinstance(p, DTensor) for p in block.parameters())  # TP (before FSDP's)
        policy = selective_policy(block)
        if policy is None or policy.learned:
            _compile_block(block, options, static_sizes)
        else:
            _compile_once_learned(block, policy, options, static_sizes)
    return model


DYNAMO_BEFORE: dict = {}  # dynamo settings apply_compile changed: their values before its first change


def _set_dynamo(name: str, value) -> None:
    DYNAMO_BEFORE.setdefault(name, getattr(torch._dynamo.config, name))
    setattr(torch._dynamo.config, name, value)


def restore_dynamo_settings() -> None:
    """Give dynamo back the settings ``apply_compile`` changed since ``DYNAMO_BEFORE`` was last emptied (a run called
    from Python: ``worker.process_state_kept``)."""
    while DYNAMO_BEFORE:
        name, value = DYNAMO_BEFORE.popitem()
        setattr(torch._dynamo.config, name, value)


def _recompute_to_the_end(block: nn.Module) -> None:
    """A checkpointed block recomputes its whole forward, not only up to its last saved tensor
    (``early_stop=False``), so the hooks that lost ``always_call`` run (module docstring)."""
    fn = getattr(block, "checkpoint_fn", None)
    if isinstance(fn, functools.partial):
        block.checkpoint_fn = functools.partial(fn, early_stop=False)


def _compile_block(block: nn.Module, options: dict, static_sizes: bool) -> None:
    """``block.compile(**options)``; its inputs are prepared before they enter the graph (module
    docstring): a tensor view that requires grad is copied, and with ``static_sizes`` a tensor of two
    or more dims is marked static."""
    block.compile(**options)
    compiled = block._compiled_call_impl

    def prepare(value):
        if isinstance(value, torch.Tensor):
            if value.requires_grad and value._is_view():
                value = value.clone()
            if static_sizes and value.dim() >= 2:
                torch._dynamo.mark_static(value)
        return value

    def call(*args, **kwargs):
        return compiled(*map(prepare, args), **{key: prepare(v) for key, v in kwargs.items()})

    block._compiled_call_impl = call


def _compile_once_learned(block: nn.Module, policy, options: dict, static_sizes: bool) -> None:
    """Compile ``block`` after the forward that teaches its selective policy which matmuls to keep
    (dynamo traces the policy's decisions into the graph, so they must be known by then); until
    then it runs eagerly."""
    def compile_when_learned(module, args, output):
        if policy.learned:
            handle.remove()
            _compile_block(module, options, static_sizes)

    handle = block.register_forward_hook(compile_when_learned)
