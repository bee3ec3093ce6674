"""hybridpar's document-resetting RG-LRU inside transformers' RecurrentGemma (Griffin) recurrent blocks,
recognised by structure, never by class name.

A transformers module is an *RG-LRU block* when it has ``linear_x``, ``linear_y`` (``D -> Cd``),
``linear_out`` (``Cd -> D``), a depthwise ``conv_1d`` over ``Cd`` channels, an ``act_fn`` and an
``rg_lru`` holding ``recurrent_param [Cd]``, ``input_gate_weight`` / ``recurrent_gate_weight
[H, w, w]`` and their biases ``[H, w]`` (``H w = Cd``). ``install_rglru_core(model)`` gives each one a
training forward that is transformers' own, step for step, with the two token mixers reset at
document boundaries::

    y = act_fn(linear_y(u));  x = linear_x(u)                [R, T, Cd]
    x = conv_1d(x)            the causal conv reads only its own document's tokens
    x = rg_lru(x)             models/linear/rglru.py: state and normaliser reset at each document
    out = linear_out(x * y)

(transformers' own block resets the RG-LRU where ``position_ids == 0`` but its conv reads across
documents). Documents come from the batch's ``PackedSeqParams``, which RecurrentGemma's decoder
layers hand to the block; without them each row is one document. With ``use_cache`` (generation)
the module's own forward runs, and is refused for several documents per row. ``block.core``
(default ``local_rglru_core``: conv and RG-LRU) is the seam context parallelism replaces
(``parallel/context/recurrent/rglru.StatePassingRglru``); tensor parallelism shards them by heads
(``parallel/tensor/hf_plans/recurrent_gemma.py``; a tp that does not divide the heads is refused:
``rglru_tp_problem``). The local sliding-window MQA layers run hybridpar's attention.

Single-device code (no process group).
"""

from __future__ import annotations

from torch import Tensor, nn

from hybridpar.models.hf.mixers.mamba1 import document_conv
from hybridpar.models.hf.mixers.mamba2 import switch_mixers
from hybridpar.models.linear.rglru import rglru
from hybridpar.models.linear.selective_scan import document_resets
from hybridpar.models.mamba.core import row_documents

__all__ = ["RGLRU_MARK", "is_rglru_block", "rglru_problem", "install_rglru_core", "rglru_blocks", "rglru_head_problem",
           "rglru_tp_problem", "rglru_training_forward", "local_rglru_core", "rglru_parameters"]

RGLRU_MARK = "hybridpar_rglru"  # set on an RG-LRU block whose forward resets at document boundaries
_GATES = ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight", "recurrent_gate_bias", "recurrent_param")


def _local(t: Tensor | None) -> Tensor | None:
    """The rank-local tensor of a (DTensor) parameter, differentiable."""
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


def is_rglru_block(module: nn.Module) -> bool:
    """Whether ``module`` has the structure of an RG-LRU block (module docstring)."""
    if type(module).__module__.startswith("hybridpar"):
        return False
    lin_x, lin_y, lin_out, conv = (getattr(module, a, None) for a in ("linear_x", "linear_y", "linear_out", "conv_1d"))
    lru = getattr(module, "rg_lru", None)
    gates = [getattr(lru, a, None) for a in _GATES]
    if not (all(isinstance(p, nn.Linear) for p in (lin_x, lin_y, lin_out)) and isinstance(conv, nn.Conv1d)
            and all(isinstance(g, Tensor) for g in gates) and callable(getattr(module, "act_fn", None))):
        return False
    w_in, b_in, w_rec, b_rec, param = gates
    width = param.numel()
    heads = b_in.shape[0] if b_in.dim() == 2 else 0
    return (param.dim() == 1 and heads > 0 and heads * b_in.shape[1] == width
            and w_in.shape == w_rec.shape == (heads, width // heads, width // heads) and b_rec.shape == b_in.shape
            and lin_x.out_features == lin_y.out_features == lin_out.in_features == width
            and conv.in_channels == conv.out_channels == conv.groups == width)


def rglru_problem(name: str, module: nn.Module) -> str | None:
    """Why the training forward cannot run RG-LRU block ``module`` exactly (None: it can)."""
    conv, where = module.conv_1d, f"RG-LRU block {name!r} ({type(module).__name__})"
    k = conv.kernel_size[0]
    if conv.stride != (1,) or conv.dilation != (1,) or conv.padding != (k - 1,) or conv.padding_mode != "zeros":
        return (f"{where} has conv stride {conv.stride}, dilation {conv.dilation}, padding {conv.padding}; the "
                f"document-resetting conv takes a causal conv (stride 1, dilation 1, zero padding {k - 1})")
    return None


def rglru_parameters(block: nn.Module) -> tuple[Tensor, ...]:
    """The RG-LRU's gate weights, biases and ``recurrent_param`` (rank-local), in ``rglru``'s order."""
    return tuple(_local(getattr(block.rg_lru, a)) for a in _GATES)


def local_rglru_core(block: nn.Module, x: Tensor, packed=None) -> Tensor:
    """The single-process core, ``block.core``'s default: ``linear_x``'s ``x [R, T, Cd] -> [R, T, Cd]``
    (conv, RG-LRU), documents reset."""
    rows, length, channels = x.shape
    cu_seqlens = None if packed is None else packed.cu_seqlens_padded
    stream = document_conv(x.reshape(rows * length, channels), block.conv_1d,
                           row_documents(cu_seqlens, rows, length, x.device))
    reset = document_resets(cu_seqlens, length, x.device)
    return rglru(stream.view(rows, length, channels), *rglru_parameters(block), first=reset, reset=reset)


def rglru_training_forward(block: nn.Module, input_states: Tensor, position_ids: Tensor | None = None,
                           attention_mask=None, use_cache: bool = True, **kwargs) -> tuple[Tensor, None]:
    """The switched forward (module docstring); ``input_states [R, T, D] -> ([R, T, D], None)``."""
    packed = kwargs.get("packed_seq_params")
    if use_cache:
        if getattr(block, "_hybridpar_head_sharded", False):  # parallel/tensor/hf_plans/recurrent_gemma.py
            raise ValueError(f"{type(block).__name__} is sharded by heads (tensor parallel), where only hybridpar's "
                             "core runs: pass use_cache=False, or generate with the unsharded model.")
        if packed is not None and packed.cu_seqlens.numel() > 2:
            raise ValueError(f"{type(block).__name__} got {packed.cu_seqlens.numel() - 1} documents per row with "
                             "use_cache=True, whose recurrent state would run across them; pass use_cache=False.")
        return block._hybridpar_transformers_forward(input_states, position_ids, attention_mask, use_cache, **kwargs)
    block.conv1d_state = block.rg_lru.recurrent_states = None  # as transformers' forward without a cache
    y_branch = block.act_fn(block.linear_y(input_states))
    x = block.core(block, block.linear_x(input_states), packed)  # [R, T, Cd]
    return block.linear_out((x * y_branch).to(input_states.dtype)), None


def install_rglru_core(model: nn.Module) -> list[str]:
    """Give every RG-LRU block of ``model`` the training forward (idempotent); returns their names.
    Raises ``ValueError`` for a variant it cannot run exactly."""
    return switch_mixers(model, is_rglru_block, rglru_problem, RGLRU_MARK, rglru_training_forward, local_rglru_core,
                         "one document per row (transformers' own forward)")


def rglru_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the blocks ``install_rglru_core`` switched."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, RGLRU_MARK, False)]


def rglru_head_problem(name: str, block: nn.Module, tp: int) -> str | None:
    """Why RG-LRU block ``block`` cannot be sharded by heads over ``tp`` ranks (None: it can)."""
    heads = block.rg_lru.input_gate_bias.shape[0]
    if heads % tp == 0:
        return None
    valid = [t for t in range(1, heads + 1) if heads % t == 0]
    return (f"RG-LRU block {name!r} ({type(block).__name__}) has {heads} heads, not divisible by tp={tp}: tensor "
            f"parallelism splits its heads (block-diagonal gates) over the TP ranks; use a tp dividing {heads} "
            f"(one of {valid})")


def rglru_tp_problem(model: nn.Module, tp: int) -> str | None:
    """Why ``model``'s switched RG-LRU blocks cannot run at this ``tp`` (None: they can, by heads:
    ``parallel/tensor/hf_plans/recurrent_gemma.py``; any ``cp``, by state passing:
    ``parallel/context/recurrent/rglru.StatePassingRglru``)."""
    for name, block in rglru_blocks(model) if tp > 1 else ():
        problem = rglru_head_problem(name, block, tp)
        if problem:
            return problem
    return None
