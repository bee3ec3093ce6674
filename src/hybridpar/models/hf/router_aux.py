"""transformers' router auxiliary (load-balancing) loss in hybridpar's objective, per pack.

A transformers MoE causal LM whose config sets ``output_router_logits`` computes in its forward
``aux_loss``, its load-balancing loss over the tokens of that call, and adds
``router_aux_loss_coef * aux_loss`` to its loss only when it is given labels. hybridpar computes the
token loss itself (``causal_lm.hf_causal_lm_loss``), so the trainer adds the term:

    objective = sum_t CE_t / N_step + coef * (1 / P_step) * sum_{packs p} aux_p

the mean over the step's ``P_step`` packs (``data.packs_per_step``) of each pack's auxiliary loss:
what the transformers Trainer optimizes with one pack per micro-batch, gradient accumulation and
data parallelism, and what one process computes over the same packs. Where a rank sees whole packs
(data parallelism, FSDP, tensor parallelism) ``aux_p`` is the model's own ``aux_loss``.

Under context parallelism a rank sees a shard of the pack. Every transformers MoE model with the
term uses Switch Transformer's form (``load_balancing_loss_func``), over the routed rows ``r`` of all
layers (``R`` of them) with ``E`` experts and top-k choices:

    aux = E * sum_e (C_e / R) (S_e / R),   C_e = #{(r, j): top-k choice j of row r is e},  S_e = sum_r softmax(z_r)_e

``C`` and ``R`` are counts (no gradient) and ``S`` is a sum over rows, so with ``C``, ``R`` summed over
the CP ranks (``reduce``) each rank's ``E sum_e (C_e / R) (S_e^rank / R)`` adds up to the pack's term,
and its gradient is the pack's share on that rank's rows. ``switch_form_problem`` checks at load
that the model's ``aux_loss`` is this form (one forward of a few tokens); a model whose term is not
is refused at cp > 1.

Padding. The packer pads each document to ``data.pad_to_multiple_of`` (default ``2*cp``), so the
rows a model routes depend on the layout; transformers' own call (no attention mask) counts them.
The term is taken over real tokens only, ``R`` = the pack's real rows, as transformers'
``load_balancing_loss_func`` does given the attention mask of an unpadded batch: the same number at
every layout and padding. A model whose term is not Switch's form keeps its own ``aux_loss``
(padding counted) at cp = 1; the trainer says so.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["router_aux_coefficient", "capture_router_aux", "router_aux_term", "switch_form_problem"]

_CAPTURED = "_hybridpar_router_aux"  # (aux_loss, router_logits) of the last forward, written by the hook
_NOT_SWITCH = "_hybridpar_router_aux_not_switch"  # set by switch_form_problem: the term cannot leave padding out
PROBE_TOKENS = 8


def router_aux_coefficient(config) -> float:
    """``router_aux_loss_coef`` of a transformers ``config`` that has its model compute the auxiliary
    loss (``output_router_logits``), else 0.0 (no term; also for a ``HybridConfig``)."""
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def capture_router_aux(model: nn.Module) -> None:
    """Keep the ``aux_loss`` and router logits of each forward of ``model`` (a transformers causal LM
    whose config asks for the term) for ``router_aux_term``; nothing for any other model."""
    if router_aux_coefficient(getattr(model, "config", None)) and not hasattr(model, _CAPTURED):
        setattr(model, _CAPTURED, None)
        model.register_forward_hook(_keep_aux)


def _keep_aux(module: nn.Module, args, output) -> None:
    """A model that returns no ``aux_loss`` (NemotronH: its router logits only) adds no term to its own loss
    either, so nothing is kept and ``router_aux_term`` adds none."""
    if isinstance(aux := getattr(output, "aux_loss", None), Tensor):
        setattr(module, _CAPTURED, (aux, getattr(output, "router_logits", None)))


def _local(t: Tensor) -> Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # a DTensor: replicated under TP


def switch_parts(router_logits: tuple[Tensor, ...], top_k: int,
                 real: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(C [E] choice counts, S [E] summed router probabilities, R routed rows)`` of Switch's form
    (module docstring) over every layer's ``[rows, E]`` logits, only the rows where ``real [rows]`` is True
    if given; ``S`` carries the gradient."""
    logits = [_local(z) for z in router_logits]
    if real is not None:
        if any(z.shape[0] != real.numel() for z in logits):
            raise RuntimeError(f"router logits of {[z.shape[0] for z in logits]} rows against {real.numel()} tokens; "
                               "the load-balancing term cannot tell padding from real rows")
        logits = [z[real.to(z.device)] for z in logits]
    dtype = torch.promote_types(logits[0].dtype, torch.float32)
    counts = torch.zeros(logits[0].shape[-1], dtype=dtype, device=logits[0].device)
    probs, rows = torch.zeros_like(counts), 0
    for z in logits:
        p = F.softmax(z.to(dtype), dim=-1)  # [rows, E]
        counts = counts + F.one_hot(p.detach().topk(top_k, dim=-1).indices.reshape(-1), p.shape[-1]).sum(0).to(dtype)
        probs, rows = probs + p.sum(0), rows + p.shape[0]
    return counts, probs, torch.tensor(float(rows), dtype=dtype, device=counts.device)


def switch_loss(counts: Tensor, probs: Tensor, rows: Tensor) -> Tensor:
    """``E * sum_e (C_e / R) (S_e / R)`` of ``switch_parts`` (summed over the ranks where they are partial)."""
    return counts.numel() * ((counts / rows) * (probs / rows)).sum()


def router_aux_term(model: nn.Module, packs_per_step: int, reduce: Callable[[Tensor], Tensor] | None = None,
                    real: Tensor | None = None) -> Tensor | None:
    """``coef * aux_p / packs_per_step`` of ``model``'s last forward, its pack's share of the step's
    objective, or None where the model adds no auxiliary loss. ``reduce`` sums a tensor over the
    ranks that share the pack (context parallelism): this rank's part of Switch's form. ``real``
    (bool ``[tokens]``, this rank's, in its order) leaves the documents' padding out (module docstring)."""
    captured = getattr(model, _CAPTURED, None)
    if captured is None:
        return None
    setattr(model, _CAPTURED, None)
    aux, router_logits = captured
    coefficient = router_aux_coefficient(model.config)
    real = None if real is None or bool(real.all()) or getattr(model, _NOT_SWITCH, False) else real
    if reduce is None and real is None:
        return coefficient * _local(aux) / packs_per_step
    counts, probs, rows = switch_parts(router_logits, model.config.num_experts_per_tok, real)
    if reduce is not None:
        counts, rows = reduce(counts), reduce(rows)
    return coefficient * switch_loss(counts, probs, rows) / packs_per_step


def switch_form_problem(model: nn.Module, vocab_size: int) -> str | None:
    """Why ``model``'s auxiliary loss is not Switch's form, found by one forward of ``PROBE_TOKENS``
    tokens (its ``aux_loss`` against ``switch_parts`` of its router logits), or None (also for a model that
    returns no ``aux_loss``: it has no term)."""
    ids = torch.arange(PROBE_TOKENS, device=next(model.parameters()).device)[None] % vocab_size
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False)
    setattr(model, _CAPTURED, None)
    aux, logits = getattr(out, "aux_loss", None), getattr(out, "router_logits", None)
    top_k = getattr(model.config, "num_experts_per_tok", None)
    if aux is None:
        return None
    if not isinstance(aux, Tensor) or not isinstance(logits, tuple) or not logits or not isinstance(top_k, int):
        return "its forward returns no aux_loss and router_logits of Switch's form"
    ours = float(switch_loss(*switch_parts(logits, top_k)))
    if abs(ours - float(aux)) > 1e-5 * abs(float(aux)):
        setattr(model, _NOT_SWITCH, True)  # router_aux_term keeps the model's own aux_loss
        return f"its aux_loss ({float(aux):.6g}) is not Switch's load-balancing form ({ours:.6g}) on a probe"
    return None
