"""Whether several documents may share a row: the rule, its first-line statement, and a probe.

Several documents are packed into one row only when every token-mixing module of the model
resets at document boundaries:

- a ``HybridLM``: its attention and Mamba cores take the pack's ``PackedSeqParams``;
- a transformers model that ``parallel/context/hf.attention_problem`` accepts: its attention
  runs hybridpar's document-causal core, its Mamba2 mixers hybridpar's Mamba core
  (``models/hf/mixers/mamba2.install_mamba_core``), its gated DeltaNets hybridpar's gated delta
  rule (``models/hf/mixers/gdn.install_gdn_core``), its gated short convolutions (LFM2) the
  document-resetting conv (``models/hf/mixers/short_conv.install_short_conv``), its Mamba1 mixers (Jamba)
  hybridpar's selective scan (``models/hf/mixers/mamba1.install_mamba1_core``), its RG-LRU blocks
  (RecurrentGemma) the same scan (``models/hf/mixers/rglru.install_rglru_core``), its Kimi Delta
  Attentions (Kimi Linear) hybridpar's KDA rule (``models/hf/mixers/kda.install_kda_core``), and no other token
  mixer exists (``unreached_token_mixers``: unknown recurrences).

Any other model trains **one document per row** (``pack_documents(one_per_row=True)``) and the
trainer says so in one line with the padding it costs. The same holds for ``hybridpar check``
and evaluation, which use the trainer's packs. ``leak_probe`` is the second guard: two short
documents packed in one row against each alone, through the model as it will train (cp = 1);
a difference above the dtype's rounding sends the model to one document per row too.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hf.mixers.gdn import gdn_layers
from hybridpar.models.hf.mixers.kda import kda_layers
from hybridpar.models.hf.mixers.mamba1 import mamba1_mixers
from hybridpar.models.hf.mixers.mamba2 import bridged_mixers
from hybridpar.models.hf.mixers.rglru import rglru_blocks
from hybridpar.models.hf.mixers.short_conv import short_convs
from hybridpar.models.hybrid import HybridLM
from hybridpar.parallel.context.hf import attention_problem, hf_attention_modules

__all__ = ["packing_problem", "leak_probe", "packing_line", "PROBE_TOLERANCE"]

PROBE_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-2}
_PROBE_DOCS = (7, 9)  # token counts of the probe's two documents


def packing_problem(model: nn.Module) -> str | None:
    """Why documents of ``model`` must not share a row (None: they may; module docstring)."""
    if isinstance(model, HybridLM):
        return None
    return attention_problem(model)


def _row_logits(model: nn.Module, ids: torch.Tensor, packed: PackedSeqParams | None) -> torch.Tensor:
    inputs = {"use_cache": False}
    if packed is not None:
        inputs.update(position_ids=packed.position_ids.to(ids.device), packed_seq_params=packed)
    if isinstance(model, HybridLM):
        return model(ids, packed=packed)
    return model(input_ids=ids, **inputs).logits


@torch.no_grad()
def leak_probe(model: nn.Module, vocab_size: int, seed: int = 0) -> float:
    """Largest ``|logits(packed) - logits(alone)| / max(1, |logits(alone)|)`` of two short
    documents (``_PROBE_DOCS`` tokens) packed in one row against each run alone; ``model`` as it
    will train at cp = 1 (hybridpar attention installed for a transformers model)."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (1, sum(_PROBE_DOCS)), generator=generator).to(device)
    cu = torch.tensor([0, _PROBE_DOCS[0], sum(_PROBE_DOCS)], dtype=torch.int32)
    packed = PackedSeqParams.from_cu_seqlens(cu)
    was_training = model.training
    model.eval()  # no dropout: the probe compares two deterministic runs
    try:
        together = _row_logits(model, ids, packed).double()
        alone = torch.cat([_row_logits(model, ids[:, :_PROBE_DOCS[0]], None),
                           _row_logits(model, ids[:, _PROBE_DOCS[0]:], None)], dim=1).double()
    finally:
        model.train(was_training)
    return float((together - alone).abs().max() / alone.abs().max().clamp_min(1.0))


def packing_line(model: nn.Module, problem: str | None, padding: float, pack_size: int, cp_pad: int | None = None) -> str:
    """The first-line statement of how documents share rows (true for the model at hand). ``cp_pad``: the padding
    multiple ``2*cp`` a run at cp > 1 chose for itself, which changes the rows against a run at another cp."""
    if cp_pad:
        return (packing_line(model, problem, padding, pack_size) + f"; each document padded to a multiple of {cp_pad} "
                "(2*cp), so a run at another cp packs other rows: to compare two runs, give both one "
                "data.pad_to_multiple_of")
    if problem is not None:
        return (f"packing: one document per row, because {problem.rstrip('.')}; padding is {100 * padding:.1f}% of "
                f"the token slots at data.pack_size={pack_size} (several documents per row would leak between them)")
    if isinstance(model, HybridLM):
        return ("packing: several documents per row; HybridLM's attention and Mamba cores reset at every document "
                f"(padding {100 * padding:.1f}% of the token slots)")
    mixers, gdn, convs = len(bridged_mixers(model)), len(gdn_layers(model)), len(short_convs(model))
    mamba1, lru, kda = len(mamba1_mixers(model)), len(rglru_blocks(model)), len(kda_layers(model))
    others = gdn or convs or mamba1 or lru or kda
    cores = [f"hybridpar's Mamba core on {mixers} Mamba2 mixers"] if mixers or not others else []
    cores += [f"its selective scan on {mamba1} Mamba1 mixers"] if mamba1 else []
    cores += [f"its RG-LRU on {lru} recurrent blocks"] if lru else []
    cores += [f"hybridpar's gated DeltaNet core on {gdn} gated DeltaNet layers"] if gdn else []
    cores += [f"its document-resetting conv on {convs} short convolutions"] if convs else []
    cores += [f"hybridpar's KDA core on {kda} Kimi Delta Attention layers"] if kda else []
    return (f"packing: several documents per row; every token mixer resets at document boundaries (hybridpar's "
            f"attention core on {len(hf_attention_modules(model))} attention modules, {', '.join(cores)}; padding "
            f"{100 * padding:.1f}% of the token slots)")
