"""Closed forms of every collective in one training step of a ``HybridLM``, by source.

One step = ``m`` packs per rank (forward + backward each), gradient clipping, AdamW. Each
source returns a ``Tally`` of ``(kind, mesh dim) -> (calls, bytes)`` that ``CommStats`` must
measure exactly (``comm_stats`` counts what a rank sends: all_gather ``(P-1) n``,
reduce_scatter and all_to_all ``(P-1)/P n``, all_reduce ``2(P-1)/P n``, n = input bytes).
Symbols: ``e`` element bytes, ``T`` tokens per pack, ``Tc = T/cp`` per CP rank, ``Ts = Tc/tp``
per SP rank, ``D`` hidden, ``V`` vocab, ``P_f = dp_shard*cp`` (FSDP shard group), ``R =
dp_replicate``. Per pack unless marked "per step":

    trainer       token count (int64) over dp, loss sum (float64) over dp*cp: 1 all_reduce each, per step
    tp_embedding  SP: reduce_scatter [Tc, D] (fwd), all_gather [Ts, D] (bwd); else all_reduce [Tc, D] (fwd)
    tp_blocks     per block, SP: norm output all_gather [Ts, D] (fwd) + reduce_scatter [Tc, D] (bwd),
                  mixer output reduce_scatter [Tc, D] (fwd) + all_gather [Ts, D] (bwd);
                  else: mixer output all_reduce [Tc, D] (fwd), mixer input grad all_reduce [Tc, D] (bwd)
    tp_head       vocab-parallel loss input: SP all_gather [Ts, D] + reduce_scatter [Tc, D]; else all_reduce
                  [Tc, D] (bwd); all_reduce of the row max [Tc] and the sums [2 Tc + 1] (fwd, >= float32)
    tp_norm_grads SP norms (blocks + norm_f) leave Partial weight grads [D]: with FSDP one all_reduce each
                  per step; without, 1 (clipping) + 3 (AdamW reads the grad 3 times) per step
    cp_attention  allgather: all_gather [Tc, 2 Hkv/tp Dh] (fwd) + reduce_scatter (bwd), per layer;
                  ulysses: 2 all_to_alls fwd + 2 bwd (``attention_cp_bytes_per_layer``)
    cp_mamba      a2a: 2 all_to_alls fwd + 2 bwd (``a2a_bytes_per_layer``); state: 2 all_gathers fwd +
                  2 reduce_scatters bwd (``state_bytes_per_layer``), per layer
    fsdp          per unit u (blocks, root) with S_u = sum over its TP-local parameters of
                  ceil(d0/P_f) * (numel/d0) * e: all_gather (P_f-1) S_u, 2 per pack for blocks
                  and 1 for the root (every unit 1 per step with reshard_after_forward=False);
                  reduce_scatter (P_f-1) S_u per step; HSDP all_reduce 2(R-1)/R S_u per step. A parameter
                  kept in float32 (``ParamShape.float32``: NemotronH's router) is a unit of its own, gathered
                  in float32 (e >= 4) under a 16-bit policy
    clip          per set of groups gradients are sharded over, and group in it: all_reduce of one summed
                  square (8 bytes: float64), per step

Under LoRA (``adapters``) a backward row runs only where a gradient reaches (``grad_flow.py``), FSDP gathers the
adapters with their units and reduces only theirs, and ``tp_adapters`` sums each replicated factor's gradient over TP.

The forms follow today's code (``tp_hybrid`` plan, ``cp_*`` cores, ``train/loss``); when one of
those changes, change its source here and the test that holds the measurement to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridpar.models.hybrid import HybridConfig
from hybridpar.models.mamba.mixer import replicated_groups, tp_groups
from hybridpar.parallel.context.attention import attention_cp_bytes_per_layer, ulysses_kv_heads
from hybridpar.parallel.context.recurrent.mamba import a2a_bytes_per_layer
from hybridpar.parallel.context.recurrent.mamba_state import state_bytes_per_layer
from hybridpar.parallel.comm.grad_flow import GradFlow
from hybridpar.parallel.comm.units import ParamShape, attention_layers, mamba_layers, unit_parameters
from hybridpar.parallel.dims import ParallelDims

__all__ = ["StepShape", "Tally", "ParamShape", "unit_parameters", "step_collectives", "SOURCES", "dim_label",
           "sent", "tp_pair", "shard_bytes",  # the byte counts plan/ prices its own collectives with
           "mamba_layers", "attention_layers"]  # ParamShape, unit_parameters and the layer counts live in units.py


class Tally(dict):
    """``{(kind, dim): [calls, bytes]}`` with ``add`` and ``+``."""

    def add(self, kind: str, dim: str, nbytes: int, calls: int = 1) -> None:
        if calls <= 0:
            return
        entry = self.setdefault((kind, dim), [0, 0])
        entry[0] += calls
        entry[1] += calls * int(nbytes)

    def __add__(self, other: "Tally") -> "Tally":
        out = Tally()
        for part in (self, other):
            for (kind, dim), (calls, nbytes) in part.items():
                entry = out.setdefault((kind, dim), [0, 0])
                entry[0] += calls
                entry[1] += nbytes
        return out

    def calls(self) -> dict[tuple[str, str], int]:
        return {key: value[0] for key, value in self.items()}

    def bytes(self) -> dict[tuple[str, str], int]:
        return {key: value[1] for key, value in self.items()}


@dataclass(frozen=True)
class StepShape:
    """What one training step's traffic depends on."""

    model: HybridConfig
    dims: ParallelDims
    pack_size: int  # T, tokens of one packed row
    packs_per_rank: int  # m
    element_size: int  # e, bytes of a parameter / activation element
    sequence_parallel: bool = False
    cp_attention: str = "allgather"
    cp_mamba: str = "a2a"
    reshard_after_forward: bool = True
    docs_per_pack: tuple[int, ...] = ()  # documents of each pack, for cp_mamba="state"
    stream_size: int | None = None  # e_s, the residual stream's and norm weights' bytes (None: e)
    # bytes of a block's norm output entering the TP region and of its output leaving it (None: e). Under
    # autocast a transformers decoder's norm outputs stay in e_s, and a layer whose branches are reduced
    # once (Falcon-H1, Granite 4.0-H) reduces them with the residual, in e_s, where SP does not shard it
    entry_size: int | None = None
    exit_size: int | None = None
    moe_exit_size: int | None = None  # a twin's MoE block's output (float32 experts' rows under bf16; None: exit)
    mamba_size: int | None = None  # the Mamba core's inputs' (Falcon-H1 under bf16 mixed precision: 4; None: e)
    # LoRA: the adapters per FSDP unit (None: every parameter trains), gathered in adapter_size bytes (2 under
    # bf16 mixed precision, else their own) and reduced in adapter_grad_size; paired: a transformers decoder
    # layer is two twin blocks and one FSDP unit
    adapters: dict | None = None
    adapter_size: int = 4
    adapter_grad_size: int = 4
    paired: bool = False

    @property
    def flow(self) -> GradFlow:
        """Which backward collectives run (``grad_flow.py``)."""
        if self.adapters is None:
            return GradFlow.full(len(self.model.pattern))
        return GradFlow.of_adapters(self.adapters, len(self.model.pattern))

    @property
    def stream_bytes(self) -> int:
        """e_s: under autocast (bf16 matmuls, float32 weights, no FSDP) the embedding's output, the
        residual stream and the norm weights' gradients stay in the weights' dtype."""
        return self.stream_size or self.element_size

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.dims.tp > 1

    @property
    def fsdp(self) -> bool:
        return self.dims.size("dp_shard_cp") > 1 or self.dims.dp_replicate > 1


def dim_label(dims: ParallelDims, names: tuple[str, ...]) -> str:
    """``CommStats``'s label of a group spanning mesh dims ``names``: those of size > 1, joined by +."""
    return "+".join(n for n in names if dims.size(n) > 1) or "self"


def sent(kind: str, size: int, nbytes: int) -> int:
    """Bytes one rank sends for an input of ``nbytes`` (the CommStats convention)."""
    return {"all_gather": (size - 1) * nbytes, "reduce_scatter": (size - 1) * nbytes // size,
            "all_reduce": 2 * (size - 1) * nbytes // size, "all_to_all": (size - 1) * nbytes // size}[kind]


# --------------------------------------------------------------------------------------------
# Sources


def trainer(s: StepShape) -> Tally:
    out, dims = Tally(), s.dims
    for names, nbytes in ((("dp_replicate", "dp_shard"), 8), (("dp_replicate", "dp_shard", "cp"), 8)):
        size = math.prod(dims.size(n) for n in names)
        if size > 1:
            out.add("all_reduce", dim_label(dims, names), sent("all_reduce", size, nbytes))
    return out


def tp_pair(out: Tally, s: StepShape, calls: int, width: int, e: int | None = None, backward: int | None = None,
             exit_: bool = False) -> None:
    """One [Tc, width] activation (``e`` bytes, default the activations') entering a TP region and its
    gradient leaving it (``exit_``: leaving it, and its gradient entering), ``calls`` times forward and
    ``backward`` times (default ``calls``) backward. Entry: SP all_gather (fwd) + reduce_scatter
    (bwd), else all_reduce of the gradient (bwd); exit: SP reduce_scatter (fwd) + all_gather (bwd),
    else all_reduce (fwd)."""
    tp, tokens, label = s.dims.tp, s.pack_size // s.dims.cp, dim_label(s.dims, ("tp",))
    e, backward = e or s.element_size, calls if backward is None else backward
    if s.sp:
        out.add("all_gather", label, sent("all_gather", tp, tokens // tp * width * e), backward if exit_ else calls)
        out.add("reduce_scatter", label, sent("reduce_scatter", tp, tokens * width * e), calls if exit_ else backward)
    else:
        out.add("all_reduce", label, sent("all_reduce", tp, tokens * width * e), calls if exit_ else backward)


def tp_embedding(s: StepShape) -> Tally:
    """The vocab-parallel embedding's partial output leaving the TP region (and its gradient)."""
    out = Tally()
    if s.dims.tp > 1:
        m = s.packs_per_rank  # fwd RS + bwd AG (a frozen embedding has none), or fwd AR
        tp_pair(out, s, m, s.model.hidden_size, s.stream_bytes, m if s.flow.base_trains else 0, exit_=True)
    return out


def tp_blocks(s: StepShape) -> Tally:
    """Every block: its input enters the TP region, its row-parallel output leaves it."""
    out = Tally()
    if s.dims.tp > 1:
        m, pattern, flow, d = s.packs_per_rank, s.model.pattern, s.flow, s.model.hidden_size
        blocks, moe = len(pattern), pattern.count("E")
        tp_pair(out, s, m * blocks, d, s.entry_size, m * flow.count(flow.input, pattern))  # norm output in (SP:
        dense = pattern.replace("E", "")  # all-gathered); mixer output out (SP: reduce-scattered)
        tp_pair(out, s, m * (blocks - moe), d, s.exit_size, m * flow.count(flow.output, pattern, dense), exit_=True)
        tp_pair(out, s, m * moe, d, s.moe_exit_size or s.exit_size, m * flow.count(flow.output, pattern, "E"),
                 exit_=True)
    return out


def tp_head(s: StepShape) -> Tally:
    """The vocab-parallel loss: its hidden input enters the TP region (as a block's does; without SP
    the loss all-reduces its hidden's gradient itself, in at least float32); forward all-reduces
    the row max [Tc] and the sums [2 Tc + 1] in at least float32; no logits move."""
    out = Tally()
    if s.dims.tp > 1:
        tp, tokens, label = s.dims.tp, s.pack_size // s.dims.cp, dim_label(s.dims, ("tp",))
        stat = max(s.element_size, 4)
        tp_pair(out, s, s.packs_per_rank, s.model.hidden_size, (s.entry_size or s.element_size) if s.sp else stat,
                 s.packs_per_rank if any(s.flow.output) else 0)
        for width in (tokens, 2 * tokens + 1):
            out.add("all_reduce", label, sent("all_reduce", tp, width * stat), s.packs_per_rank)
    return out


def tp_shared_groups(s: StepShape) -> Tally:
    """One B/C group under TP: per Mamba layer and pack, the gated norm all-reduces its sum of
    squares [Tc, 1] (forward, and its gradient in backward; at least float32), and each replicated
    B/C parameter's gradient is all-reduced (backward)."""
    out, cfg, tp = Tally(), s.model, s.dims.tp
    if not replicated_groups(cfg.mamba_n_groups, tp):
        return out
    label, tokens, layers = dim_label(s.dims, ("tp",)), s.pack_size // s.dims.cp, mamba_layers(cfg.pattern)
    if getattr(cfg, "mamba_gated_norm", True):  # y * silu(z) without a norm sums nothing
        backward = s.flow.count(s.flow.mamba, cfg.pattern, "MP")
        out.add("all_reduce", label, sent("all_reduce", tp, tokens * max(s.element_size, 4)),
                (layers + backward) * s.packs_per_rank)
    if not s.flow.base_trains:  # frozen B/C weights
        return out
    unit = unit_parameters(cfg, tp, s.sequence_parallel)
    for prefix, params in unit.items():
        for p in params:
            if p.name.endswith(("_B", "_C")) and not p.tp_sharded:
                out.add("all_reduce", label, sent("all_reduce", tp, math.prod(p.shape) * s.stream_bytes),
                        s.packs_per_rank)
    return out


def tp_norm_grads(s: StepShape) -> Tally:
    out = Tally()
    if s.sp and s.flow.base_trains:
        norms = [p for unit in unit_parameters(s.model, s.dims.tp, True).values() for p in unit if p.sp_norm]
        per_norm = 1 if s.fsdp else 4  # FSDP reduces once; else clipping once and AdamW three times
        for p in norms:
            nbytes = math.prod(p.shape) * s.stream_bytes
            out.add("all_reduce", dim_label(s.dims, ("tp",)), sent("all_reduce", s.dims.tp, nbytes), per_norm)
    return out


def tp_head_norms(s: StepShape) -> Tally:
    """Per-head q/k norms (Qwen3 twin) on this rank's heads: their weight gradient [head_dim] is a
    partial sum, all-reduced over TP in backward once per call (two per attention layer and pack)."""
    out = Tally()
    if s.dims.tp > 1 and getattr(s.model, "qk_norm", False) and s.flow.base_trains:
        calls = 2 * s.model.pattern.count("*") * s.packs_per_rank
        nbytes = s.model.head_dim * s.stream_bytes
        out.add("all_reduce", dim_label(s.dims, ("tp",)), sent("all_reduce", s.dims.tp, nbytes), calls)
    return out


def cp_attention(s: StepShape) -> Tally:
    out, cfg, cp, e = Tally(), s.model, s.dims.cp, s.element_size
    if cp == 1:
        return out
    m, flow, pattern = s.packs_per_rank, s.flow, s.model.pattern
    if not (layers := attention_layers(pattern) * m):  # no attention block (pattern 'M-M-'): a KeyError below
        return out
    hq, hkv = cfg.num_attention_heads // s.dims.tp, cfg.num_key_value_heads // s.dims.tp
    label = dim_label(s.dims, ("cp",))
    forward = round(attention_cp_bytes_per_layer(s.cp_attention, 1, s.pack_size, cp, hq, hkv, cfg.head_dim, e))
    if s.cp_attention == "allgather":  # [dK | dV] reduce-scattered where k or v has a gradient
        out.add("all_gather", label, forward, layers)
        out.add("reduce_scatter", label, forward, flow.count(flow.kv, pattern, "*P") * m)
        return out
    tokens, kv_heads = s.pack_size // cp, ulysses_kv_heads(hkv, cp)  # ulysses: [q|k|v] and out, each way
    per_head = sent("all_to_all", cp, tokens * cfg.head_dim * e)
    out.add("all_to_all", label, per_head * (hq + 2 * kv_heads), layers)
    out.add("all_to_all", label, per_head * hq, layers)
    # sent() floors each head's bytes: equal to the closed form up to a byte per head (cp=3 was an AssertionError)
    assert abs(out.bytes()["all_to_all", label] - layers * forward) <= layers * 2 * (hq + kv_heads)
    for i, kind in enumerate(pattern):  # backward: the gradients of those of q, k, v that have one, and the output's
        grads = hq * flow.q[i] + kv_heads * (flow.k[i] + flow.v[i])
        if kind in "*P" and grads:
            out.add("all_to_all", label, per_head * grads, m)
            out.add("all_to_all", label, per_head * hq, m)
    return out


def cp_mamba(s: StepShape) -> Tally:
    out, cfg, cp, tp, e = Tally(), s.model, s.dims.cp, s.dims.tp, s.mamba_size or s.element_size
    layers, label = mamba_layers(s.model.pattern), dim_label(s.dims, ("cp",))
    backward = s.flow.count(s.flow.mamba, s.model.pattern, "MP")  # layers whose core runs backward
    if cp == 1 or layers == 0:  # no Mamba block (a pattern of attention and MLPs): nothing to send
        return out
    d_inner, heads, groups = cfg.mamba_intermediate_size // tp, cfg.mamba_num_heads // tp, tp_groups(cfg.mamba_n_groups, tp)
    state = cfg.ssm_state_size
    if s.cp_mamba == "a2a":  # [x | B | C | dt] in, y back; the same two transposed in backward
        tokens, groups_sent = s.pack_size // cp, groups * max(1, cp // groups)
        calls = (layers + backward) * s.packs_per_rank
        for width in (d_inner + 2 * groups_sent * state + heads, d_inner):
            out.add("all_to_all", label, sent("all_to_all", cp, tokens * width * e), calls)
        forward = a2a_bytes_per_layer(1, s.pack_size, cp, d_inner, heads, groups, state, e)
        assert abs(out.bytes()["all_to_all", label] - forward * calls) <= 2 * calls  # sent() floors each width
        return out
    if len(s.docs_per_pack) != s.packs_per_rank:
        raise ValueError(f"cp_mamba='state' sends per document: give docs_per_pack for all {s.packs_per_rank} packs.")
    for docs in s.docs_per_pack:  # conv halo tails [2 docs, K-1, C], then (h_end, a_seg) [2 docs, H p N + H]
        halo = 2 * docs * (cfg.conv_kernel - 1) * (d_inner + 2 * groups * state) * e
        states = 2 * docs * (heads * cfg.mamba_head_dim * state + heads) * max(e, 4)
        for nbytes in (halo, states):
            out.add("all_gather", label, sent("all_gather", cp, nbytes), layers)
            out.add("reduce_scatter", label, sent("reduce_scatter", cp, cp * nbytes), backward)
        assert (cp - 1) * (halo + states) == state_bytes_per_layer(
            1, docs, cp, d_inner, heads, cfg.mamba_head_dim, groups, state, cfg.conv_kernel, e, max(e, 4))
    return out


def shard_bytes(params: list[ParamShape], shard: int, e: int) -> int:
    """Bytes of one rank's FSDP shard of ``params`` (dim 0 split ``shard`` ways, padded), ``e`` per element."""
    return sum(math.ceil(p.shape[0] / shard) * math.prod(p.shape[1:]) * e for p in params)


def fsdp(s: StepShape) -> Tally:
    out, dims = Tally(), s.dims
    if not s.fsdp:
        return out
    shard, rep = dims.size("dp_shard_cp"), dims.dp_replicate
    if not isinstance(s.reshard_after_forward, bool):
        raise ValueError(f"parallel.reshard_after_forward={s.reshard_after_forward} (a resharding group) is not priced: the "
                         "closed forms cover true and false; plan both, its memory and traffic lie between them.")
    shard_label, rep_label = dim_label(dims, ("dp_shard", "cp")), dim_label(dims, ("dp_replicate",))
    m, flow, blocks = s.packs_per_rank, s.flow, len(s.model.pattern)
    units = blocks // 2 if s.paired else blocks
    reduce_size = max(s.element_size, 4)  # parameters gathered in e, gradients reduced in >= float32
    for unit, all_params in unit_parameters(s.model, dims.tp, s.sequence_parallel).items():
        adapters = (s.adapters or {}).get(unit, [])
        # a parameter kept in float32 is a unit of its own under a 16-bit policy (data/fsdp.float32_units)
        kept = [p for p in all_params if p.float32] if s.element_size < 4 else []
        params = [p for p in all_params if not (p.float32 and kept)]
        parts = [(shard_bytes(params, shard, s.element_size) + shard_bytes(adapters, shard, s.adapter_size),
                  shard_bytes(params, shard, reduce_size) if s.adapters is None  # LoRA: the adapters' gradients
                  else shard_bytes(adapters, shard, s.adapter_grad_size))] + [
            (shard_bytes([p], shard, 4), shard_bytes([p], shard, reduce_size) if s.adapters is None else 0) for p in kept]
        index = int(unit.rsplit(".", 1)[1]) // (2 if s.paired else 1) if unit else -1
        backward = unit != "" and flow.gathered_in_backward(index, units, s.paired)
        gathers = 1 if not s.reshard_after_forward else m * (2 if backward else 1)
        for nbytes, grad_bytes in parts:
            if shard > 1:
                out.add("all_gather", shard_label, sent("all_gather", shard, nbytes), gathers)
                if grad_bytes:
                    out.add("reduce_scatter", shard_label, sent("reduce_scatter", shard, shard * grad_bytes))
            if rep > 1 and grad_bytes:
                out.add("all_reduce", rep_label, sent("all_reduce", rep, grad_bytes))
    return out


def tp_adapters(s: StepShape) -> Tally:
    """LoRA under TP: each replicated factor (``A`` of a column-parallel base, ``B`` of a row-parallel one, a shared
    B/C group's rows of an ``in_proj`` ``B``) has a gradient summed over TP (in bf16 under FSDP's bf16; autocast: own):
    one all-reduce per pack, or with FSDP once per step (it reduces TP-partial gradients itself, after the last pack);
    an ``in_proj``'s ``A`` and shared rows sum in autograd, per pack."""
    out = Tally()
    if s.adapters is None or s.dims.tp == 1:
        return out
    label, m, e = dim_label(s.dims, ("tp",)), s.packs_per_rank, s.adapter_size if s.fsdp else s.adapter_grad_size
    for params in s.adapters.values():
        for p in params:
            if not p.tp_sharded:
                nbytes = sent("all_reduce", s.dims.tp, math.prod(p.shape) * e)
                out.add("all_reduce", label, nbytes, m if p.tp_sum_in_autograd or not s.fsdp else 1)
    return out


def clip(s: StepShape) -> Tally:
    """``clip_grad_norm``: one all_reduce of a summed square (float64) per set of groups the
    gradients are sharded over and per group in it: FSDP shards every gradient over dp_shard x cp,
    TP shards some over tp too; without FSDP the embedding's gradient comes back replicated."""
    out, dims = Tally(), s.dims
    e = 8  # train/optim.clip_grad_norm sums squares in float64
    fsdp = s.fsdp and dims.size("dp_shard_cp") > 1
    units = unit_parameters(s.model, dims.tp, s.sequence_parallel) if s.adapters is None else s.adapters
    params = [p for unit in units.values() for p in unit]
    tp_sets = {p.tp_sharded and (s.fsdp or p.name != "backbone.embeddings.weight") for p in params}
    for tp_sharded in tp_sets:
        if fsdp:
            out.add("all_reduce", dim_label(dims, ("dp_shard", "cp")), sent("all_reduce", dims.size("dp_shard_cp"), e))
        if tp_sharded:
            out.add("all_reduce", dim_label(dims, ("tp",)), sent("all_reduce", dims.tp, e))
    return out


SOURCES = {
    "trainer": trainer, "tp_embedding": tp_embedding, "tp_blocks": tp_blocks, "tp_head": tp_head,
    "tp_norm_grads": tp_norm_grads, "tp_head_norms": tp_head_norms, "tp_shared_groups": tp_shared_groups, "cp_attention": cp_attention, "cp_mamba": cp_mamba, "fsdp": fsdp, "clip": clip,
    "tp_adapters": tp_adapters,
}


def step_collectives(shape: StepShape) -> dict[str, Tally]:
    """Every source's tally for one training step (sum them for the step's total)."""
    return {name: source(shape) for name, source in SOURCES.items()}
