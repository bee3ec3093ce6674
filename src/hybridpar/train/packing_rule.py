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

Before any of that, a token must see only its past: ``causality_problem`` refuses a model whose config makes
its attention bidirectional (``is_decoder: false`` on BERT-like classes, ``is_causal: false``,
``use_bidirectional_attention``) before any process starts, and ``future_probe`` checks the loaded model (a
change to the last token must leave every earlier position's logits alone): trained on its shifted labels,
such a model reads each target from its input.
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

__all__ = ["packing_problem", "leak_probe", "packing_line", "causality_problem", "future_probe", "PROBE_TOLERANCE"]

PROBE_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-2}
_PROBE_DOCS = (7, 9)  # token counts of the probe's two documents


def packing_problem(model: nn.Module) -> str | None:
    """Why documents of ``model`` must not share a row (None: they may; module docstring)."""
    if isinstance(model, HybridLM):
        return None
    return attention_problem(model)


def _reads_is_decoder(model: nn.Module) -> bool:
    """Whether ``model``'s class reads ``config.is_decoder`` (BERT-like classes warn there without it; GPT-NeoX's
    config carries ``is_decoder: false`` and its attention is causal all the same)."""
    import inspect

    try:
        return "is_decoder" in inspect.getsource(type(model).__init__)
    except (OSError, TypeError):
        return False


def causality_problem(model: nn.Module) -> str | None:
    """Why ``model`` (as built: a meta model will do) is not causal by its config, naming the field and the fix
    (None: its config claims causal attention)."""
    config, cls = getattr(model, "config", None), type(model).__name__
    fields = [(k, v) for k, v in (("is_decoder", getattr(config, "is_decoder", None) if _reads_is_decoder(model) else None),
                                  ("is_causal", getattr(config, "is_causal", None))) if v is False]
    bidirectional = getattr(config, "use_bidirectional_attention", None)
    if bidirectional in (True, "all"):
        fields.append(("use_bidirectional_attention", bidirectional))
    if not fields:
        return None
    key, value = fields[0]
    fix = "false" if key == "use_bidirectional_attention" else "true"
    return (f"{cls} has {key}={value!r}: its attention is bidirectional, so every position sees the token it is "
            f"trained to predict (a causal LM's shifted labels); set \"{key}\": {fix} in its config.json, or train "
            "a decoder checkpoint")


@torch.no_grad()
def future_probe(model: nn.Module, vocab_size: int) -> str | None:
    """Why ``model`` is not causal as it runs: the last of ``sum(_PROBE_DOCS)`` tokens changed moves an earlier
    position's logits (None: it does not)."""
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab_size, (1, sum(_PROBE_DOCS)), generator=torch.Generator().manual_seed(1)).to(device)
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % vocab_size
    was_training = model.training
    model.eval()
    try:
        before, after = (_row_logits(model, row, None)[:, :-1].double() for row in (ids, changed))
    finally:
        model.train(was_training)
    gap = float((before - after).abs().max() / before.abs().max().clamp_min(1.0))
    if gap <= PROBE_TOLERANCE.get(next(model.parameters()).dtype, 3e-2):
        return None
    return (f"{type(model).__name__} is not causal: changing the last of {ids.shape[1]} tokens moves the logits of "
            f"earlier positions ({gap:.1e}, relative), so training on shifted labels would read each target from the "
            "input; train a decoder (causal) checkpoint")


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
