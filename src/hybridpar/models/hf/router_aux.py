"""transformers' router auxiliary (load-balancing) loss in hybridpar's objective, per pack.

A transformers MoE causal LM whose config sets ``output_router_logits`` computes in its forward
``aux_loss``, its load-balancing loss over the tokens of that call (Switch/Mixtral's
``E * sum_e f_e P_e``: ``f_e`` the share of routed slots, ``P_e`` the mean router probability of
expert ``e``), and adds ``router_aux_loss_coef * aux_loss`` to its loss only when it is given labels.
hybridpar computes the token loss itself (``causal_lm.hf_causal_lm_loss``), so the trainer adds
the term:

    objective = sum_t CE_t / N_step + coef * (1 / P_step) * sum_{packs p} aux_p

the mean over the step's ``P_step`` packs (``data.packs_per_step``) of each pack's auxiliary loss.
That is what the transformers Trainer optimizes with one pack per micro-batch, gradient
accumulation and data parallelism, and what one process computes over the same packs; so every
layout whose ranks each see whole packs is exact (data parallelism, FSDP, tensor parallelism:
every TP rank routes every token of its pack). Under context parallelism a rank's ``f_e`` and
``P_e`` would be those of its shard of the pack: ``router_aux_problem`` refuses it.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["router_aux_coefficient", "capture_router_aux", "take_router_aux", "router_aux_term", "router_aux_problem"]

_CAPTURED = "_hybridpar_router_aux"  # the attribute the forward hook writes the last aux_loss to


def router_aux_coefficient(config) -> float:
    """``router_aux_loss_coef`` of a transformers ``config`` that has its model compute the auxiliary
    loss (``output_router_logits``), else 0.0 (no term; also for a ``HybridConfig``)."""
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def capture_router_aux(model: nn.Module) -> None:
    """Keep the ``aux_loss`` of each forward of ``model`` (a transformers causal LM whose config asks
    for it) for ``take_router_aux``; nothing for any other model."""
    if router_aux_coefficient(getattr(model, "config", None)) and not hasattr(model, _CAPTURED):
        setattr(model, _CAPTURED, None)
        model.register_forward_hook(_keep_aux)


def _keep_aux(module: nn.Module, args, output) -> None:
    setattr(module, _CAPTURED, getattr(output, "aux_loss", None))


def take_router_aux(model: nn.Module) -> Tensor | None:
    """The auxiliary loss (a scalar with its graph) of ``model``'s last forward, once; None where the
    model computes none."""
    aux = getattr(model, _CAPTURED, None)
    if aux is not None:
        setattr(model, _CAPTURED, None)
        if hasattr(aux, "full_tensor"):  # a DTensor (replicated under TP)
            aux = aux.full_tensor()
    return aux


def router_aux_term(model: nn.Module, packs_per_step: int) -> Tensor | None:
    """``coef * aux_loss / packs_per_step`` of ``model``'s last forward (its pack's share of the step's
    objective, module docstring), or None where the model adds no auxiliary loss."""
    aux = take_router_aux(model)
    return None if aux is None else router_aux_coefficient(model.config) * aux / packs_per_step


def router_aux_problem(config, cp: int, path: str | None) -> str | None:
    """Why ``config``'s router auxiliary loss cannot be computed exactly at this layout, or None."""
    coefficient = router_aux_coefficient(config)
    if not coefficient or cp == 1:
        return None
    return (f"{type(config).__name__.removesuffix('Config')} adds a router auxiliary loss (output_router_logits=true, "
            f"router_aux_loss_coef={coefficient:g}) computed over the tokens each forward sees; at cp={cp} a rank sees a "
            "shard of the pack, so its load balance is not the pack's; use parallel.cp=1, or set "
            f"\"output_router_logits\": false in {path or 'the checkpoint'}/config.json to train without it.")
