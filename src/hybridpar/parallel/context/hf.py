"""Context parallelism for Hugging Face attention models through transformers' attention interface.

hybridpar registers one attention implementation, ``"hybridpar"``, with transformers'
``AttentionInterface``. A transformers attention module computes ``q, k, v`` (projections,
q/k norms, RoPE at the ``position_ids`` it was given) and calls
``attention(module, q [B, Hq, S, Dh], k, v [B, Hkv, S, Dh], mask, scaling=s, sliding_window=W, **kwargs)``;
ours transposes to ``[B, S, H, Dh]`` and runs the CP strategy ``apply_hf_cp`` installed on the
module (``context/attention.py``: ``allgather``, ``ulysses``, ``ring``) with the batch's
``PackedSeqParams`` from ``kwargs["packed_seq_params"]``, so the math is the strategies' own:
for query ``i`` and key ``j`` at global positions ``p`` in documents ``d``::

    out_i = sum_j softmax_j(s q_i . k_j | M_ij) v_j,   M_ij = [d_j = d_i] [p_j <= p_i] [p_i - p_j < W]

(the window term only on sliding layers: Mistral with ``sliding_window``, Gemma3's local
layers, Qwen2/3 with ``use_sliding_window``; a module that keeps ``sliding_window`` but does not
pass it has it read from the module; Gemma2's ``softcap`` ``c`` replaces ``s q_i . k_j``
by ``c tanh(s q_i . k_j / c)``). Multi-head latent attention hands over ``v [B, H, S, Dv]`` with
``Dv`` other than q/k's ``Dh``: the narrower side is zero-padded to one head dim (zero q/k
columns add nothing to ``q . k``; zero v columns give output columns that are dropped), so the
cores keep one head dim. Llama 4's chunked layers and temperature tuning equal transformers'
for documents and rows of bounded length (``hf_types.check_document_limit``); longer ones raise. No ``[S, S]``
mask exists: the
strategies run the blockwise core. transformers builds no mask for an implementation
without a registered mask function (``attention_mask`` arrives as None).

Rotary positions follow the zigzag layout because the model receives this rank's *global*
position ids: ``hf_cp_inputs(sharded)`` returns ``position_ids [B, S/P]`` = position of each
local token inside its document (``packed.position_ids``, which ``shard_inputs`` localized),
so ``cos/sin`` are those of the single-process run, token for token.

Without a CP core (a model set to ``"hybridpar"`` at cp=1) the single-process core runs
on the documents of ``packed_seq_params``, or else of ``position_ids`` (a new document
where ``position_ids[0]`` does not continue by 1, as transformers detects packing).

Under ``torch.compile`` the function is plain tensor code around the strategy: dynamo
traces it with the block (the core is one custom op per direction), no graph breaks.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.attention.mixer import sequence_layout
from hybridpar.models.attention.kernels import attention_core
from hybridpar.models.attention.layout import AttentionLayout
from hybridpar.models.hf.mixers.gdn import MARK as GDN_MARK, gdn_layers
from hybridpar.models.hf.mixers.kda import KDA_MARK, kda_layers
from hybridpar.models.hf.mixers.mamba1 import MAMBA1_MARK, mamba1_mixers
from hybridpar.models.hf.mixers.mamba2 import MARK, bridged_mixers
from hybridpar.models.hf.mixers.rglru import RGLRU_MARK, rglru_blocks
from hybridpar.models.hf.mixers.short_conv import SHORT_CONV_MARK, short_convs
from hybridpar.models.mamba.mixer import tp_groups
from hybridpar.models.token_dropout import unkeyed_dropout
from hybridpar.parallel.context.hf_types import (ATTENTION_MODEL_TYPES, HYBRID_MODEL_TYPES, SUPPORTED_MODEL_TYPES,
                                                 check_document_limit)
from hybridpar.parallel.context.hf_inputs import hf_cp_inputs, packed_from_position_ids

__all__ = [
    "ATTENTION_MODEL_TYPES",
    "ATTENTION_NAME",
    "HYBRID_MODEL_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "apply_hf_cp",
    "attention_problem",
    "hf_attention",
    "hf_attention_modules",
    "hf_cp_inputs",
    "is_hf_model",
    "packed_from_position_ids",
    "register_hf_attention",
    "runs_hybridpar_attention",
    "switched_mixers",
    "unreached_token_mixers",
    "refuse_unread_documents",
    "use_hybridpar_attention",
    "validate_hf_cp",
]

ATTENTION_NAME = "hybridpar"
CORE_ATTRIBUTE = "hybridpar_cp_core"
PACKED_ATTRIBUTE = "hybridpar_packed_seq_params"  # {"packed_seq_params": the model's last} (apply_hf_cp)
_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")  # frequencies from max(position_ids): differs per rank


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (without importing transformers)."""
    return any(cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers")
               for cls in type(model).__mro__)


# ----------------------------------------------------------------------------- the attention function


def _position_layout(position_ids: Tensor, device) -> AttentionLayout:
    """Documents of row 0 where its position ids do not continue by 1 (transformers' packing rule)."""
    pos = position_ids.reshape(-1, position_ids.shape[-1])[0].to(device)
    new_doc = torch.ones_like(pos, dtype=torch.bool)
    new_doc[1:] = pos[1:] - pos[:-1] != 1
    return AttentionLayout.sequence(torch.cumsum(new_doc.to(torch.int32), 0) - 1)  # on-device, no host sync


_NOT_PASSED = object()  # sliding_window not handed over at all (a None handed over means "no window")


def hf_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None,
                 dropout: float = 0.0, sliding_window=_NOT_PASSED, softcap=None,
                 packed_seq_params: PackedSeqParams | None = None, position_ids: Tensor | None = None,
                 **kwargs) -> tuple[Tensor, None]:
    """transformers attention: ``q, k [B, Hq|Hkv, S, Dh]``, ``v [B, Hkv, S, Dv]`` -> ``([B, S, Hq, Dv], None)``."""
    where = f"hybridpar attention in {type(module).__name__}"
    if attention_mask is not None:
        raise ValueError(f"{where} got an attention mask; it takes documents and padding from packed_seq_params "
                         "(hf_cp_inputs) instead: drop attention_mask.")
    if dropout:
        raise ValueError(f"{where}: attention dropout ({dropout}) is not supported; set attention_dropout=0.")
    sinks = kwargs.get("s_aux")  # GPT-OSS: one logit per (local) query head, models/attention/sinks.py
    if not torch.compiler.is_compiling():
        check_document_limit(module, where, query.shape[2], packed_seq_params, position_ids)
    if sliding_window is _NOT_PASSED:  # a module that keeps its window but leaves it to the mask (Qwen2-MoE)
        sliding_window = getattr(module, "sliding_window", None) or None
    value_dim = value.shape[-1]
    if value_dim != query.shape[-1]:  # MLA: v's head dim is not q/k's; the cores take one head dim
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        query, key, value = _same_head_dim(query, key, value)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, H, S, Dh] -> [B, S, H, Dh]
    core = getattr(module, CORE_ATTRIBUTE, None)
    if core is not None:
        if packed_seq_params is None:  # a decoder layer that keeps the model's kwargs from its attention
            packed_seq_params = getattr(module, PACKED_ATTRIBUTE, {}).get("packed_seq_params")
        if packed_seq_params is None:
            raise ValueError(f"{where} runs context parallel but got no packed_seq_params; call the model with "
                             "**hf_cp_inputs(shard_inputs(..., cp_group=...)).")
        out = core(q, k, v, packed_seq_params, scale=scaling, sliding_window=sliding_window, softcap=softcap,
                   **({} if sinks is None else {"sinks": sinks}))
        return out[..., :value_dim], None
    if packed_seq_params is not None or position_ids is None:
        layout = sequence_layout(packed_seq_params, q.shape[1], q.device)
    else:
        if not torch.compiler.is_compiling() and not bool((position_ids == position_ids[:1]).all()):
            raise ValueError(f"{where}: rows have different position ids; every row of a batch shares one document "
                             "layout, so pass packed_seq_params=packed_from_position_ids(row) per row.")
        layout = _position_layout(position_ids, q.device)
    out = attention_core(q, k, v, layout, scale=scaling, sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    return out[..., :value_dim], None


def _same_head_dim(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``q, k [B, H, S, Dqk]``, ``v [B, Hkv, S, Dv]`` zero-padded to ``max(Dqk, Dv)``: zero columns of
    q and k add nothing to ``q . k``, zero columns of v give output columns ``Dv:``, which the caller
    drops (their gradient never reaches v's real columns)."""
    width = max(query.shape[-1], value.shape[-1])
    return tuple(x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))
                 for x in (query, key, value))


def register_hf_attention() -> str:
    """Register ``hf_attention`` as transformers attention ``"hybridpar"`` (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, hf_attention)
    return ATTENTION_NAME


# ----------------------------------------------------------------------------- rules and installation


def hf_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every transformers self-attention module: a class named ``*Attention``
    (LongCat-Flash: ``*MLA``) with a config and a head dim (``head_dim``; MLA: ``qk_head_dim``;
    GPT-NeoX: ``head_size``)."""
    return [(name, m) for name, m in model.named_modules() if type(m).__name__.endswith(("Attention", "MLA"))
            and hasattr(m, "config") and any(hasattr(m, dim) for dim in ("head_dim", "qk_head_dim", "head_size"))]


def _attention_heads(module: nn.Module) -> tuple[int, int]:
    """Query and key/value heads an attention module hands the attention function (whole model, no TP).
    MLA (``kv_lora_rank``) expands its latent to one key and value per query head."""
    heads = module.config.num_attention_heads
    if hasattr(module, "kv_lora_rank"):
        return heads, heads
    return heads, getattr(module.config, "num_key_value_heads", None) or heads


def _rope_types(config) -> set[str]:
    found = set()

    def walk(value):
        if isinstance(value, dict):
            if isinstance(value.get("rope_type") or value.get("type"), str):
                found.add(value.get("rope_type") or value.get("type"))
            for item in value.values():
                walk(item)

    walk(getattr(config, "rope_parameters", None))
    walk(getattr(config, "rope_scaling", None))
    return found


def switched_mixers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every token mixer switched onto a hybridpar core (Mamba2, gated DeltaNet,
    short conv, Mamba1, RG-LRU, Kimi Delta Attention)."""
    return (bridged_mixers(model) + gdn_layers(model) + short_convs(model) + mamba1_mixers(model) + rglru_blocks(model)
            + kda_layers(model))


def unreached_token_mixers(model: nn.Module) -> list[str]:
    """Names of modules that mix tokens outside hybridpar's cores: a direct ``A_log`` parameter
    (a Mamba1, gated DeltaNet or Mamba2 mixer not switched by ``install_mamba1_core`` /
    ``install_gdn_core`` / ``install_mamba_core``) or an ``nn.Conv1d`` over the sequence (short
    convolutions), outside a switched mixer or short conv (``models/hf/mixers/short_conv.install_short_conv``)."""
    inside = tuple(f"{name}." for name, _ in switched_mixers(model))
    found = []
    for name, module in model.named_modules():
        marks = (MARK, GDN_MARK, SHORT_CONV_MARK, MAMBA1_MARK, RGLRU_MARK, KDA_MARK)
        switched = any(getattr(module, mark, False) for mark in marks)
        if switched or (inside and name.startswith(inside)):
            continue
        if isinstance(module, nn.Conv1d) or "A_log" in dict(module.named_parameters(recurse=False)):
            found.append(f"{name} ({type(module).__name__})")
    return found


def attention_problem(model: nn.Module) -> str | None:
    """Why hybridpar's attention cannot stand in for ``model``'s (None: it can), at any cp.

    Rules: a transformers model of a supported type (``SUPPORTED_MODEL_TYPES``: attention models and
    the Mamba2 hybrids of ``HYBRID_MODEL_TYPES``), causal, without attention dropout, with attention
    modules to take it, and no token mixer outside hybridpar's cores (``unreached_token_mixers``;
    Mamba2 mixers must have been switched by ``models.hf.mixers.mamba2.install_mamba_core``).
    """
    cls = type(model).__name__
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    unreached = unreached_token_mixers(model)
    if unreached:
        return (f"{cls} ({model_type}) has token mixers that hybridpar's attention and Mamba cores do not reach "
                f"({unreached[0]}{f' and {len(unreached) - 1} more' if len(unreached) > 1 else ''}: a recurrence, "
                "convolution or mixer variant hybridpar has no core for), so they cannot reset at document boundaries; "
                "Mamba1 and Mamba2 mixers, RG-LRU blocks, gated DeltaNets and Kimi Delta Attentions reach our cores "
                "through install_mamba1_core, install_mamba_core, install_rglru_core, install_gdn_core and "
                "install_kda_core in models.hf.mixers (the trainer calls them), "
                "or load the checkpoint as a HybridLM (Mamba2, Bamba, dense NemotronH).")
    if not is_hf_model(model) or model_type not in SUPPORTED_MODEL_TYPES:
        return (f"hybridpar's attention takes HybridLM and {len(SUPPORTED_MODEL_TYPES)} transformers model types, each "
                f"proven exact (ATTENTION_MODEL_TYPES and HYBRID_MODEL_TYPES in hybridpar.parallel.context.hf; "
                f"docs/hf-models.md lists them), and the model is a {cls} (model_type {model_type!r}).")
    if not getattr(config, "is_causal", True) or getattr(config, "use_bidirectional_attention", False) in (True, "all"):
        return (f"the attention of {cls} is bidirectional (use_bidirectional_attention/is_causal=False); hybridpar's "
                "attention core is causal.")
    for key, p in unkeyed_dropout(config).items():  # attention_dropout, GPT-2's attn_pdrop, BERT's, ...
        return f"{cls} has {key}={p:g}, which hybridpar's attention core does not apply; set config.{key} = 0.0."
    if not hf_attention_modules(model) and not switched_mixers(model):  # an attention-free model of our cores
        return (f"no attention modules found in {cls} (classes named *Attention with a config and a head dim); this model "
                "cannot take hybridpar's attention.")
    return None


def validate_hf_cp(model: nn.Module, attention_core, tp: int = 1, mamba_core=None) -> None:
    """Raise ``ValueError`` unless hybridpar can run ``model`` context parallel (no communication):
    ``attention_problem``'s rules, no rope whose frequencies depend on the largest position,
    every attention module's per-TP-rank heads fit ``attention_core``, and every transformers
    Mamba2 mixer on hybridpar's core (its heads and groups per TP rank) fits ``mamba_core``."""
    cls = type(model).__name__
    problem = attention_problem(model)
    if problem:
        raise ValueError(f"context parallelism (cp > 1) for {cls}: {problem} It runs on hybridpar's attention only: "
                         "change that, or use cp=1 (TP and FSDP still apply).")
    for name, mixer in bridged_mixers(model):
        if mamba_core is None:
            raise ValueError(f"context parallelism (cp > 1) for {cls}: Mamba2 mixer {name!r} needs a Mamba CP strategy "
                             "(cp_mamba 'a2a' or 'state'); pass one to validate_hf_cp.")
        heads, groups = mixer.num_heads, mixer.n_groups
        if heads % tp == 0 and tp_groups(groups, tp):  # sharded by heads under TP (tensor/hf_plans/moe_hybrid.py; one
            heads, groups = heads // tp, tp_groups(groups, tp)  # group whole); else the TP check refuses it
        try:
            mamba_core.validate(heads, groups)
        except ValueError as error:
            raise ValueError(f"Mamba2 mixer {name!r} at cp={mamba_core.cp_size}, tp={tp}: {error}") from None
    bad_rope = sorted(_rope_types(model.config) & set(_POSITION_DEPENDENT_ROPE))
    if bad_rope:
        raise ValueError(f"context parallelism for {cls}: rope type {bad_rope[0]!r} chooses its frequencies from the "
                         "largest position id a rank holds, which differs between context-parallel ranks; use a "
                         "static rope (default, linear, yarn, llama3) or cp=1.")
    for name, module in hf_attention_modules(model):
        heads, kv_heads = _attention_heads(module)
        try:
            # one KV head stays whole on every TP rank (multi-query: tensor/hf_plans/recurrent_gemma.py)
            attention_core.validate_heads(heads // tp, kv_heads // tp if kv_heads % tp == 0 else kv_heads)
        except ValueError as error:
            raise ValueError(f"module {name!r} at cp={attention_core.cp_size}, tp={tp}: {error}") from None


def _refuse_attention_mask(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """transformers drops a 2-D mask for an implementation without a mask function: refuse it instead."""
    if kwargs.get("attention_mask") is not None or (len(args) > 1 and args[1] is not None):
        raise ValueError(f"{type(module).__name__} runs hybridpar's context-parallel attention, which takes documents "
                         "and padding from packed_seq_params, not attention_mask; drop attention_mask and describe "
                         "padding with PackedSeqParams (cu_seqlens_padded), labels -100 on padding.")


def apply_hf_cp(model: nn.Module, attention_core) -> nn.Module:
    """Install ``attention_core`` (a CP strategy) on every attention module and switch the model to
    ``"hybridpar"`` attention; run after ``validate_hf_cp`` and tensor parallelism.

    Each forward also leaves its ``packed_seq_params`` on every attention module: a decoder layer
    that does not pass the model's keyword arguments on to its attention (StableLM's) still gets
    them there, in forward and in an activation-checkpointed recompute of the same step."""
    slot = {}  # one slot shared by every attention module: the hook writes it once per forward
    for _, module in hf_attention_modules(model):
        setattr(module, CORE_ATTRIBUTE, attention_core)
        setattr(module, PACKED_ATTRIBUTE, slot)

    def keep_packed(_, args: tuple, kwargs: dict) -> None:
        slot["packed_seq_params"] = kwargs.get("packed_seq_params")

    model.register_forward_pre_hook(keep_packed, with_kwargs=True)
    return use_hybridpar_attention(model)


def use_hybridpar_attention(model: nn.Module) -> nn.Module:
    """Switch ``model`` to ``"hybridpar"`` attention (blockwise, documents from ``packed_seq_params``,
    no ``[S, S]`` mask; one process without a CP core) and refuse ``attention_mask`` from now on."""
    model.set_attn_implementation(register_hf_attention())
    model.register_forward_pre_hook(_refuse_attention_mask, with_kwargs=True)
    return model


def refuse_unread_documents(model: nn.Module) -> nn.Module:
    """Refuse, at forward, a ``packed_seq_params`` of several documents that some token mixer of
    ``model`` would not read: transformers' own attention (``sdpa``, ``eager``, ...) ignores it and
    lets the documents attend to each other, and so does every mixer ``unreached_token_mixers``
    names. One document per row always passes. ``parallelize`` installs it on transformers models."""
    if getattr(model, "_hybridpar_documents_guard", False):
        return model
    unreached = unreached_token_mixers(model)
    has_attention = bool(hf_attention_modules(model))

    def refuse(module: nn.Module, args: tuple, kwargs: dict) -> None:
        packed = kwargs.get("packed_seq_params")
        if packed is None or packed.cu_seqlens.numel() <= 2:  # [0, T]: one document per row
            return
        docs = packed.cu_seqlens.numel() - 1
        if unreached:
            raise ValueError(f"packed_seq_params describes {docs} documents per row, but {type(module).__name__}'s "
                             f"{unreached[0]} mixes tokens outside hybridpar's cores and would leak between them; "
                             "pass one document per row.")
        if has_attention and not runs_hybridpar_attention(module):
            fix = attention_problem(module)
            fix = ("call hybridpar.parallel.context.hf.use_hybridpar_attention(model) first (the trainer does)"
                   if fix is None else "pass one document per row")
            raise ValueError(f"packed_seq_params describes {docs} documents per row, but {type(module).__name__} runs "
                             f"transformers' {module.config._attn_implementation!r} attention, which ignores it and "
                             f"lets the documents attend to each other; {fix}.")

    model.register_forward_pre_hook(refuse, with_kwargs=True)
    model._hybridpar_documents_guard = True
    return model


def runs_hybridpar_attention(model: nn.Module) -> bool:
    """Whether ``model`` runs ``"hybridpar"`` attention (it then reads ``packed_seq_params``)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == ATTENTION_NAME
