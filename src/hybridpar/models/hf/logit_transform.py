"""What a transformers causal LM does to ``lm_head``'s output ``z`` before returning its logits.

The chunked loss (``models/lm_head_loss.py``) takes the head's input and weight, never the logits,
so it must apply the model's transform itself. transformers' models apply at most these, read from
their config (and their modeling files, transformers 5.x):

    config field               models                                 logits
    final_logit_softcapping    Gemma 2, Gemma 3 (text), Gemma 4, ...  tanh(z / c) * c
    logits_soft_cap            RecurrentGemma                         tanh(z / c) * c
    logit_scale                Cohere, Cohere 2                       z * s
    logits_scaling             Granite, GraniteMoe(Shared, Hybrid)    z / v          (s = 1 / v)
    lm_head_multiplier         Falcon-H1                              z * model.model.lm_head_multiplier
    output_multiplier_scale    none in transformers                   unknown: the logits path

``logit_transform(model)`` gives ``(s, c)``: the loss runs on ``c tanh(s z / c)`` (``s z`` without
a cap). A config field is only a claim, so ``probe_logits_after_head`` runs the model once at load
(eval mode, a few tokens) and checks the returned logits against ``(s, c)`` applied to the head's
own output: equal for the identity, equal to the dtype's rounding otherwise (``probe_tolerance``: each logit to 4 ulps
of itself, so in bfloat16 a transform within ~3% of the mapped one passes; in float32 and float64 any other).
A mismatch, or a transform under a name nobody maps, is recorded on the model and sends its loss
through the logits (``causal_lm.chunked_head``). A model never probed is taken at its config's word.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["LOGIT_TRANSFORMS", "LOSS_TERMS", "logit_transform", "loss_term_problem", "describe_transform",
           "apply_transform", "probe_logits_after_head", "probe_finding"]

# config field -> what the forward does with it: "cap" c tanh(z / c), "scale" z * v, "divide" z / v, None unknown
LOGIT_TRANSFORMS: dict[str, str | None] = {
    "final_logit_softcapping": "cap", "logits_soft_cap": "cap", "logit_scale": "scale", "logits_scaling": "divide",
    "lm_head_multiplier": "scale", "output_multiplier_scale": None,
}
# config field -> the term transformers' own loss adds to the cross entropy, which hybridpar's loss does not
LOSS_TERMS: dict[str, str] = {"z_loss_coefficient": "a z-loss, {v:g} x mean(logsumexp(logits)^2),"}  # Bamba
_FOUND = "_hybridpar_logits_after_head"  # set by the probe: None (verified) or what differs
_BEFORE_HEAD = "_hybridpar_transform_before_head"  # set by the probe: the fields (as they were) act on the head's input


def _fields(model: nn.Module) -> dict[str, object]:
    """The ``LOGIT_TRANSFORMS`` fields ``model``'s config (or its text config) sets to more than the identity."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else None
    found = {}
    for field in LOGIT_TRANSFORMS:
        value = getattr(config, field, None)
        value = getattr(text, field, None) if value is None and text is not None else value
        if not (value is None or value is False or (type(value) in (int, float) and value == 1)):  # 0.0 is no identity
            found[field] = value
    return found


def logit_transform(model: nn.Module) -> tuple[float, float | None]:
    """``(scale, softcap)`` of ``model``'s logits over ``lm_head``'s output, from its config fields
    (module docstring); ``(1.0, None)`` for none, or when the probe saw the returned logits equal the head's output
    (MiniCPM3 divides the hidden states by ``logits_scaling`` before ``lm_head``: the chunked loss, which reads the
    head's input, already has it). ``ValueError`` for a field nobody maps, a value that is not a finite number > 0,
    or two caps (no model applies both)."""
    if getattr(model, _BEFORE_HEAD, None) == _fields(model):  # the probe's verdict, for these very fields
        return 1.0, None
    scale, cap = 1.0, None
    for field, value in _fields(model).items():
        kind = LOGIT_TRANSFORMS[field]
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else float("nan")
        if kind is None or not 0 < number < math.inf or (kind == "cap" and cap is not None):
            raise ValueError(f"{type(model).__name__} sets {field}={value!r}, a logit transform hybridpar does not "
                             f"map{'' if kind is None else ' to a finite scale > 0 (or one cap)'}")
        if kind == "cap":
            cap = float(number)
        else:
            scale *= float(number) if kind == "scale" else 1.0 / float(number)
    return scale, cap


def describe_transform(scale: float, softcap: float | None) -> str:
    """``"c tanh(s z / c)"`` (or ``"s z"``) with the numbers: what the loss runs on."""
    if softcap is not None:
        inner = "z" if scale == 1.0 else f"{scale:g} z"
        return f"{softcap:g} tanh({inner} / {softcap:g})"
    return "z" if scale == 1.0 else f"{scale:g} z"


def apply_transform(logits: Tensor, scale: float, softcap: float | None) -> Tensor:
    """``c tanh(s z / c)`` or ``s z`` of ``logits`` (a new tensor)."""
    logits = logits * scale
    return torch.tanh(logits / softcap) * softcap if softcap is not None else logits


def probe_tolerance(logits: Tensor) -> Tensor:
    """The rounding a transform in ``logits``' dtype may leave, per logit: 4 ulps of it (each of a scale, a
    division, tanh and a product rounds once, relative to its value), and 4 ulps of a thousandth of the
    largest logit (the head's own rounding near zero)."""
    size = logits.double().abs()
    return 4 * torch.finfo(logits.dtype).eps * (size + 1e-3 * size.max())


def loss_term_problem(model: nn.Module) -> str | None:
    """Why hybridpar's loss (cross entropy on the logits) is not the one ``model``'s config asks for: a
    ``LOSS_TERMS`` field set above 0 (None: no such term)."""
    config = getattr(model, "config", None)
    for field, term in LOSS_TERMS.items():
        value = getattr(config, field, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0:
            return (f"{type(model).__name__} sets {field}={value!r}: transformers' own loss adds {term.format(v=value)} "
                    "to the cross entropy, and hybridpar's loss is the cross entropy alone, so training would minimize "
                    f"another objective than the one its config asks for; set \"{field}\": 0.0 in its config.json to train without it")
    return None


@torch.no_grad()
def probe_logits_after_head(model: nn.Module, tokens: int = 4) -> str | None:
    """Run ``tokens`` ids through ``model`` once (eval mode, no cache) and check its returned logits against
    ``logit_transform(model)`` of ``lm_head``'s output; returns (and keeps on the model) None when they agree,
    else what differs: a transform under a name not in ``LOGIT_TRANSFORMS`` or not as it says. ``ValueError``
    for a loss term the config adds that hybridpar's loss lacks (``loss_term_problem``: Bamba's z-loss)."""
    if problem := loss_term_problem(model):
        raise ValueError(f"{problem}.")
    head = model.get_output_embeddings()
    if head is None:
        return None
    seen = {}
    handle = head.register_forward_hook(lambda module, args, out: seen.__setitem__("out", out))
    was_training = model.training
    model.eval()
    try:
        ids = torch.arange(tokens, device=head.weight.device)[None] % head.weight.shape[0]
        logits = model(input_ids=ids, use_cache=False).logits
    finally:
        handle.remove()
        model.train(was_training)
    out = seen.get("out")
    try:
        scale, cap = logit_transform(model)
    except ValueError as error:
        found = str(error)
    else:
        found = None
        if out is None or out.shape != logits.shape:
            found = "its forward changes lm_head's output (other shape)"
        elif (scale, cap) == (1.0, None) and not torch.equal(out, logits):
            found = f"its forward changes lm_head's output (max change {(logits - out).abs().max().item():.1e})"
        elif (scale, cap) != (1.0, None) and torch.equal(out, logits):  # applied to the head's input, or not at all
            setattr(model, _BEFORE_HEAD, _fields(model))
        elif (scale, cap) != (1.0, None):
            gap = (apply_transform(out.double(), scale, cap) - logits.double()).abs()
            if not bool((gap <= probe_tolerance(logits)).all()):
                gap = gap.max().item()
                fields = ", ".join(f"{k}={v!r}" for k, v in _fields(model).items())
                found = (f"its forward changes lm_head's output otherwise than {describe_transform(scale, cap)} "
                         f"({fields}) says: {gap:.1e} apart")
    setattr(model, _FOUND, found)
    return found


def probe_finding(model: nn.Module) -> str | None:
    """What ``probe_logits_after_head`` found on ``model`` (None: agreed, or never probed)."""
    return getattr(model, _FOUND, None)
