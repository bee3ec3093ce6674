"""``hybridpar check``: one step under the configured layout against a single process.

Every rank also builds the single-device model from the same seed, runs the same step's
packs through it, and compares the loss and the full (gathered) gradient of every
parameter. A user's proof that their layout computes what one GPU would, for a ``HybridLM``
and for a transformers model alike (``trainer.pack_loss_sum``).

Also compared: the gradient norm that ``train.grad_clip`` clips by and the run logs
(``optim.clip_grad_norm``, its own reductions over the shards), and in float64 the first AdamW update
of every parameter (clipped, at the schedule's first rate, with weight decay: the trainer's optimizer on
its shards against one process's). A gradient of another shape, one
a process has that the other has not, and one that differs between ranks (a replicated
parameter whose replicas disagree: each rank compares its own copy, and every rank's failures
are gathered into the one verdict) fail.

A quantity passes when ``|parallel - reference| <= tolerance * max(1, |reference|)`` with
both sides finite: a NaN or infinity anywhere fails. The default tolerance follows the
dtype the step runs in (bf16 under ``parallel.mixed_precision=bf16``). Only float64 results
within 1e-9 are called "exact"; lower precisions pass "within tolerance".
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from hybridpar.config import ConfigError, RunConfig
from hybridpar.parallel.context.inputs import shard_inputs
from hybridpar.parallel.state import canonical_state_dict, load_canonical_state_dict
from hybridpar.train.loss import real_token_mask, valid_token_count
from hybridpar.train.optim import build_optimizer, build_scheduler, clip_grad_norm
from hybridpar.models.hybrid import HybridLM
from hybridpar.train.hf_model import use_blockwise_attention
from hybridpar.train.peft import apply_peft, key_dropout
from hybridpar.models.hf.router_aux import router_aux_term
from hybridpar.train.trainer import Trainer, build_model, pack_loss_sum, pack_tensors

TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2}
EXACT = 1e-9  # float64 results within this are "exact"
LORA_B_STD = 0.1  # draw_lora_b


def default_tolerance(config: RunConfig) -> float:
    """The tolerance of the dtype the parallel step computes in."""
    if config.parallel.mixed_precision == "bf16":
        return TOLERANCES[torch.bfloat16]
    return TOLERANCES[getattr(torch, config.model.dtype)]


def within(difference: float, scale: float, tolerance: float) -> bool:
    """The pass rule; False for any non-finite value."""
    return math.isfinite(difference) and math.isfinite(scale) and difference <= tolerance * max(1.0, scale)


def reference_step(model, packs, device) -> torch.Tensor:
    """Loss of step 0 on one process (gradients left in ``model``)."""
    count = sum(valid_token_count(p["labels"]) for p in packs)
    total = torch.zeros((), dtype=torch.float64)
    for index, pack in enumerate(packs):
        input_ids, labels, packed = pack_tensors(pack, device)
        sharded = shard_inputs(input_ids=input_ids, labels=labels, packed=packed)
        key_dropout(model, 0, index, sharded)  # LoRA dropout: the masks the parallel step drew
        loss_sum, _ = pack_loss_sum(model, sharded)
        aux = router_aux_term(model, len(packs), None, real_token_mask(pack))  # transformers' MoE load balancing, per pack
        (loss_sum / count + (0 if aux is None else aux)).backward()
        total += loss_sum.detach().double() + (0 if aux is None else aux.detach().double() * count)
    return total / count


def _largest(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def gradient_rows(reference: torch.nn.Module, reference_grads: dict, parallel_grads: dict) -> list[tuple[str, float, float]]:
    """``(name, largest difference, scale)`` of every gradient; inf (fails) for one only one side has or shaped
    otherwise (a ``[1, n]`` gradient broadcast against an ``[m, n]`` one compared equal; ``[m+1, n]`` was a
    traceback)."""
    rows = []
    for name, param in reference.named_parameters():
        if param.grad is None:  # a frozen base weight: the parallel run must not have a gradient either
            rows.append((f"grad {name} (frozen)", float(name in parallel_grads), 0.0))
    for name, grad in reference_grads.items():
        theirs = parallel_grads.get(name)
        if theirs is None:  # no gradient reached it under the layout: it would never train (was a KeyError)
            rows.append((f"grad {name} (none under the layout)", math.inf, _largest(grad)))
        elif theirs.shape != grad.shape:
            rows.append((f"grad {name} (shape {tuple(theirs.shape)} under the layout, {tuple(grad.shape)} on one "
                         "process)", math.inf, _largest(grad)))
        else:
            rows.append((f"grad {name}", _largest(theirs.to(grad.dtype) - grad), _largest(grad)))
    known = set(reference_grads) | {name for name, _ in reference.named_parameters()}
    for name in sorted(set(parallel_grads) - known):
        rows.append((f"grad {name} (only under the layout: one process has no such parameter)", math.inf, 0.0))
    return rows


@torch.no_grad()
def update_rows(trainer, reference: torch.nn.Module, config: RunConfig,
                tolerance: float) -> list[tuple[str, float, float]]:
    """AdamW's first update of every parameter, ``p_1 - p_0``, under the layout (``train.grad_clip``, the
    trainer's optimizer and schedule on its shards) against one process's (``build_optimizer``), by canonical
    name: one row per parameter whose update differs, else one row. Only in float64: at step 1 AdamW moves
    each element by about ``lr * g / (|g| + eps)``, so a gradient near 0 turns float32's rounding into an
    update of up to ``lr`` either way. Steps both models (compare the gradients first). Collective."""
    if config.model.dtype != "float64" or config.parallel.mixed_precision:
        return []
    before = (canonical_state_dict(trainer.model), canonical_state_dict(reference))
    clip_grad_norm(trainer.model.parameters(), config.train.grad_clip)
    trainer.optimizer.step()
    optimizer = build_optimizer(reference, config.train)
    build_scheduler(optimizer, config.train)  # the first step's rate, as the trainer's schedule set it
    clip_grad_norm(reference.parameters(), config.train.grad_clip)
    optimizer.step()
    after = (canonical_state_dict(trainer.model), canonical_state_dict(reference))
    rows, worst = [], (0.0, 0.0)
    for name, one in after[1].items():
        if name not in after[0] or after[0][name].shape != one.shape:
            continue  # a row of gradient_rows already
        layout_update, one_update = after[0][name] - before[0][name], one - before[1][name]
        difference, scale = float((layout_update - one_update).abs().max()), float(one_update.abs().max())
        if not within(difference, scale, tolerance):
            rows.append((f"AdamW update of {name}", difference, scale))
        worst = max(worst, (difference, scale))
    return rows or [(f"AdamW update at step 1 ({len(after[1])} parameters, lr {optimizer.param_groups[0]['lr']:.2e})",
                     *worst)]


def decay_rows(trainer, reference: torch.nn.Module, config: RunConfig) -> list[tuple[str, float, float]]:
    """AdamW's weight-decay group of every trainable parameter under the layout (the trainer's optimizer, grouped on
    the parallelized model's names, shapes and marks) against one process's (``build_optimizer``), by canonical name:
    one failed row per parameter decayed on one side only, else one row. Overwrites the gradients (read them
    first). Collective."""
    if not config.train.weight_decay:
        return []
    flags = {}
    for name, model, optimizer in (("layout", trainer.model, trainer.optimizer),
                                   ("one", reference, build_optimizer(reference, config.train))):
        decayed = {id(p) for group in optimizer.param_groups if group["weight_decay"] for p in group["params"]}
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.full_like(p, float(id(p) in decayed))
        flags[name] = canonical_state_dict(model, grads=True)  # parts stored apart fused, shards gathered
    rows = []
    for name, one in flags["one"].items():
        layout = flags["layout"].get(name)
        if layout is not None and not torch.equal(layout, one):
            rows.append((f"weight decay of {name} ({'on' if bool(layout.any()) else 'off'} under the layout, "
                         f"{'on' if bool(one.any()) else 'off'} on one process)", math.inf, 0.0))
    return rows or [(f"weight decay groups ({len(flags['one'])} parameters)", 0.0, 0.0)]


def failures_of_every_rank(rows: list, failures: list[str], exact: bool) -> tuple[list, list[str], bool]:
    """Every rank compares its own copy of each gradient (a replicated one is each rank's local tensor): the
    failures of all ranks, a row that failed elsewhere only named with those ranks, and exact only if every rank
    is, so rank 0's verdict and every rank's exit code are the job's (rank 0 said "exact" where rank 1's replica
    differed). Collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return rows, failures, exact
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (failures, exact))
    ranks = {name: [rank for rank, (names, _) in enumerate(every) if name in names]
             for names, _ in every for name in names}
    elsewhere = {name: f"{name} [rank {', '.join(map(str, where))} only: the ranks' copies differ]"
                 for name, where in ranks.items() if 0 not in where}
    return ([(elsewhere.get(name, name), d, scale) for name, d, scale in rows], [elsewhere.get(n, n) for n in ranks],
            all(flag for _, flag in every))


def print_rows(rows, failures) -> None:
    """One line per compared quantity: its largest difference and ok/FAIL (rank 0 prints)."""
    for name, difference, _ in rows:
        print(f"  {name:<58} max|diff| {difference:.3e}  {'FAIL' if name in failures else 'ok'}")


def precision_words(config: RunConfig) -> str:
    """What the compared step ran in: ``bf16 mixed precision against one float32 process`` (the reference has no
    autocast or FSDP policy: it is the float32 model), else the model's dtype."""
    if config.parallel.mixed_precision == "bf16":
        return f"bf16 mixed precision against one {config.model.dtype} process"
    return config.model.dtype


def passed_within_rounding(count: int, tolerance: float, config: RunConfig, words: str | None = None) -> str:
    """The verdict of a pass short of exact; the advice names every key the exact check needs (a float64 model
    with ``parallel.mixed_precision=bf16`` is refused)."""
    exact = "model.dtype=float64" + (" parallel.mixed_precision=null" if config.parallel.mixed_precision else "")
    return (f"passed: all {count} quantities within tolerance {tolerance:.0e} in {words or precision_words(config)} "
            f"(equal to rounding, not exact: run with {exact} for the exact check)")


@torch.no_grad()
def draw_lora_b(reference: torch.nn.Module, model: torch.nn.Module) -> int:
    """LoRA's ``B`` factors start at zero, where ``dA = B^T (...)`` is zero in both models whatever the layout does
    with it: such a check could not fail on ``A``. When every ``B`` of ``reference`` is zero, both models get the same
    seeded normal ``B`` (``model`` through the canonical names, sharded like each parameter: an expert adapter's
    gate and up rows stored apart are one tensor there); returns how many. A ``B`` not loaded fails the check."""
    factors = {name: p for name, p in reference.named_parameters() if ".lora_B." in name}
    if not factors or any(bool(p.any()) for p in factors.values()):
        return 0
    generator = torch.Generator().manual_seed(0)
    for _, p in sorted(factors.items()):
        p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64).mul_(LORA_B_STD))
    state = {name: value for name, value in canonical_state_dict(reference).items() if ".lora_B." in name}
    load_canonical_state_dict(model, state, strict=False)
    return len(state)


def run_check(config: RunConfig, device: torch.device, tolerance: float | None = None) -> int:
    """Print one line per quantity with its largest difference; 0 when all are in tolerance.

    The default tolerance follows the dtype (1e-9 for float64)."""
    if tolerance is not None and not (math.isfinite(tolerance) and tolerance > 0):
        raise ValueError(f"--tolerance {tolerance} is invalid: it must be a finite number > 0; e.g. --tolerance 1e-6.")
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, tf32=False))  # never TF32
    reference = apply_peft(config, build_model(config)).to(device)  # peft.method=lora: adapters only train
    if not isinstance(reference, HybridLM):
        use_blockwise_attention(reference)  # the attention the trainer runs (documents from packed_seq_params)
    trainer = Trainer(config, device)
    if trainer.unkeyed:  # random numbers each rank draws for itself: no layout can equal one process
        raise ConfigError(f"check cannot prove this layout: {trainer.unkeyed}")
    for model in (trainer.model, reference):  # as training runs (from_pretrained returns eval mode): dropout on
        model.train()
    drawn = draw_lora_b(reference, trainer.model)
    tolerance = tolerance if tolerance is not None else default_tolerance(config)
    parallel_loss = trainer.step_gradients(0)
    if parallel_loss is None:  # on every rank alike (a global count): "unsupported operand ... 'NoneType'" before
        raise ConfigError(f"check compares step 0, but its {config.data.packs_per_step} pack(s) of data.pack_size="
                          f"{config.data.pack_size} hold no labelled token (nothing to compare); use a larger "
                          "data.pack_size (or data.packs_per_step).")
    parallel_grads = canonical_state_dict(trainer.model, grads=True)

    parallel_norm = clip_grad_norm(trainer.model.parameters(), math.inf)  # what train.grad_clip clips by; no clipping
    reference_loss = reference_step(reference, trainer.train_data.step_packs(0), device)

    rows = [("loss", float((parallel_loss - reference_loss).abs()), float(reference_loss.abs()))]
    rows += gradient_rows(reference, canonical_state_dict(reference, grads=True), parallel_grads)
    reference_norm = clip_grad_norm(reference.parameters(), math.inf)
    rows.append(("grad norm (train.grad_clip clips by it)", float((parallel_norm - reference_norm).abs()),
                 float(reference_norm)))
    rows += update_rows(trainer, reference, config, tolerance)  # float64: the first update (steps both models)
    rows += decay_rows(trainer, reference, config)  # the update's groups (the gradients are compared above)
    exact = (config.model.dtype == "float64" and config.parallel.mixed_precision is None
             and all(difference <= EXACT * max(1.0, scale) for _, difference, scale in rows))
    rows, failures, exact = failures_of_every_rank(
        rows, [name for name, d, scale in rows if not within(d, scale, tolerance)], exact)
    if dist.get_rank() == 0:
        p = config.parallel
        print(f"check: dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} cp={p.cp} tp={p.tp} "
              f"sp={p.sequence_parallel} cp_attention={p.cp_attention} cp_mamba={p.cp_mamba} "
              f"dtype={config.model.dtype}" + (f" mixed_precision={p.mixed_precision} (the reference: one float32 process)"
                                                if p.mixed_precision else "") +
              f" tolerance={tolerance:.0e} (relative to max(1, |reference|))")
        if drawn:
            print(f"LoRA: {drawn} B factors drawn at random (std {LORA_B_STD}) in both models for this check: at their "
                  "zero start every A's gradient is zero on any layout, which proves nothing")
        print_rows(rows, failures)
        if failures:
            verdict = f"FAILED: {len(failures)} of {len(rows)} quantities out of tolerance or not finite"
        elif exact:
            verdict = f"exact: all {len(rows)} quantities within {EXACT:.0e} in float64"
        else:
            verdict = passed_within_rounding(len(rows), tolerance, config)
        print(f"check {verdict}", flush=True)
    return 1 if failures else 0
