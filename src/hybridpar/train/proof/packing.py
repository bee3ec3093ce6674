"""``hybridpar check --packing``: packed rows against the same documents one per row.

For the user's model and data (the packs of step 0, packed several documents per row at
``data.pack_size`` whatever the packing rule decides), one process runs the packed rows and
then every document alone in a row of its own, and compares the loss (summed over the step's
labelled tokens, divided by their count, as training does) and the gradient of every
parameter. Equal means no conv, SSM state or attention crosses a document boundary, for this
model as it trains (``HybridLM``'s cores; a transformers model on hybridpar's attention and
Mamba cores, at cp = 1). It prints like the layout proof (``train/proof/layout.py``: one line per
quantity, the same pass rule and verdicts, exit 0 or 1) and first says what training does with
this model (``train/packing_rule.py``): a model the rule trains one document per row is shown
leaking here, but training never packs it.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from hybridpar.config import RunConfig
from hybridpar.data.packing import padding_fraction
from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hybrid import HybridLM
from hybridpar.parallel.context.inputs import shard_inputs
from hybridpar.train.batches import PackStream, pad_multiple, validate_data
from hybridpar.train.proof.layout import EXACT, TOLERANCES, passed_within_rounding, print_rows, within
from hybridpar.train.hf_model import use_blockwise_attention
from hybridpar.train.loss import valid_token_count
from hybridpar.train.peft import apply_peft, lora_line
from hybridpar.train.packing_rule import PROBE_TOLERANCE, leak_probe, packing_line, packing_problem
from hybridpar.train.run.tokenizer import shared_data
from hybridpar.train.trainer import build_model, pack_loss_sum, pack_tensors

__all__ = ["documents_alone", "run_packing_check"]


def documents_alone(input_ids: torch.Tensor, labels: torch.Tensor, packed: PackedSeqParams):
    """``(ids [1, n], labels [1, n], PackedSeqParams)`` of every document of a pack, each in a row
    of its own (its real tokens only: the pack's padding has no label)."""
    starts = packed.cu_seqlens_padded.tolist()
    lengths = (packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]).tolist()
    for start, length in zip(starts, lengths):
        if length > 0:
            cu = torch.tensor([0, length], dtype=torch.int32)
            yield (input_ids[:, start:start + length], labels[:, start:start + length],
                   PackedSeqParams.from_cu_seqlens(cu))


def _step(model, rows, count: int) -> torch.Tensor:
    """Loss of the rows (summed token losses / ``count``), gradients left in ``model``."""
    total = torch.zeros((), dtype=torch.float64)
    for input_ids, labels, packed in rows:
        loss_sum, _ = pack_loss_sum(model, shard_inputs(input_ids=input_ids, labels=labels, packed=packed))
        (loss_sum / count).backward()
        total += loss_sum.detach().double()
    return total / count


def _training_rule(config: RunConfig, model, vocab_size: int) -> str | None:
    """What the trainer decides at cp = 1 (``Trainer._packing_problem``): the rule, then the probe."""
    problem = packing_problem(model)
    if problem is None and not isinstance(model, HybridLM):
        leak = leak_probe(model, vocab_size)
        tolerance = PROBE_TOLERANCE.get(next(model.parameters()).dtype, 3e-2)
        if not leak <= tolerance:
            problem = (f"the leak probe found two packed documents' logits {leak:.1e} (relative) away from each run "
                       f"alone, above {tolerance:.0e}")
    return problem


def _layout_note(config: RunConfig) -> str:
    """What a layout given to ``check --packing`` does: nothing (the comparison is one process's; every process of
    the job ran it alike), said, so a pass is not read as packing proven under that layout; nor are mixed precision,
    activation checkpointing and compile used (both runs are the plain eager model), said too."""
    p = config.parallel
    degrees = [f"parallel.{name}={getattr(p, name)}" for name in ("dp_replicate", "dp_shard", "cp", "tp")
               if getattr(p, name) != 1]
    notes = [] if not degrees else [f"layout: {', '.join(degrees)} not used here: the packed and one-per-row runs are "
                                    "one process's (each process ran the same); hybridpar check without --packing "
                                    "proves the layout"]
    if p.mixed_precision:
        notes.append(f"parallel.mixed_precision={p.mixed_precision} not used here: both runs compute in "
                     f"{config.model.dtype}, held to its tolerance")
    wrapped = [f"parallel.{name}={value}" for name, value in (("activation_checkpointing", p.activation_checkpointing),
                                                                ("compile", p.compile)) if value not in ("none", False)]
    if wrapped:  # a compiled block runs other kernels (on CUDA: FlexAttention, the fused scans) than the eager one
        notes.append(f"{', '.join(wrapped)} not used here: both runs are the eager model without checkpointing; "
                     "hybridpar check without --packing runs the layout with them")
    return "; ".join(notes)


def run_packing_check(config: RunConfig, device: torch.device, tolerance: float | None = None) -> int:
    """Print one line per quantity (packed against one document per row); 0 when all agree."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    # no autocast or FSDP policy here: both runs compute in model.dtype, and so does the default tolerance
    tolerance = tolerance if tolerance is not None else TOLERANCES[getattr(torch, config.model.dtype)]
    adapters = dataclasses.replace(config, peft=dataclasses.replace(config.peft, dropout=0.0))  # no mask to match
    model = apply_peft(adapters, build_model(config)).to(device)  # peft.method=lora: adapters only train
    vocab_size = model.config.vocab_size
    data = shared_data(config, vocab_size)
    tokenizer = validate_data(data, vocab_size, config.model.hf_path)
    if not isinstance(model, HybridLM):
        use_blockwise_attention(model)  # the attention the trainer runs at cp = 1
    problem = _training_rule(config, model, vocab_size)
    stream = PackStream(data, 1, vocab_size, pad_to_multiple_of=pad_multiple(data, 1), tokenizer=tokenizer)
    packs = [pack_tensors(pack, device, vocab_size) for pack in stream.step_packs(0)]
    alone = [row for pack in packs for row in documents_alone(*pack)]
    count = sum(valid_token_count(labels) for _, labels, _ in packs)
    packed_loss = _step(model, packs, count)
    packed_grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    alone_loss = _step(model, alone, count)

    rows = [("loss", float((packed_loss - alone_loss).abs()), float(alone_loss.abs()))]
    for name, param in model.named_parameters():
        packed_grad, alone_grad = packed_grads.get(name), param.grad
        if packed_grad is None and alone_grad is None:
            continue
        if packed_grad is None or alone_grad is None:  # was a KeyError (one per row only) or not compared (packed only)
            rows.append((f"grad {name} (only {'packed' if alone_grad is None else 'one per row'})", math.inf, 0.0))
            continue
        rows.append((f"grad {name}", float((packed_grad - alone_grad).abs().max()), float(alone_grad.abs().max())))
    failures = [name for name, difference, scale in rows if not within(difference, scale, tolerance)]
    exact = (config.model.dtype == "float64"
             and all(difference <= EXACT * max(1.0, scale) for _, difference, scale in rows))
    if rank == 0:
        print(f"check --packing: {len(alone)} documents in {len(packs)} packed row(s) (step 0, data.pack_size="
              f"{data.pack_size}) against one document per row; dtype={config.model.dtype} tolerance={tolerance:.0e} "
              "(relative to max(1, |one per row|))")
        trained = stream if problem is None else PackStream(data, 1, vocab_size, pad_to_multiple_of=pad_multiple(data, 1),
                                                            tokenizer=tokenizer, one_per_row=True)
        print(f"  training: {packing_line(model, problem, padding_fraction(trained.pool), data.pack_size)}")
        if note := _layout_note(config):
            print(f"  {note}")
        if lora_line(model):
            print(f"  {lora_line(model)}" + (f" (peft.dropout={config.peft.dropout:g} off here: packed and alone rows "
                                             "would draw other masks)" if config.peft.dropout else ""))
        if len(alone) == len(packs):
            print("  no row holds two documents (each fills a row at this data.pack_size): nothing can leak, the "
                  "comparison below is trivial")
        print_rows(rows, failures)
        if failures:
            verdict = (f"FAILED: {len(failures)} of {len(rows)} quantities differ: packed documents see each other"
                       + (" (training packs this model one document per row, so training is not affected)"
                          if problem else ""))
        elif exact:
            verdict = f"exact: all {len(rows)} quantities within {EXACT:.0e} in float64; packed documents never meet"
        else:
            verdict = passed_within_rounding(len(rows), tolerance, config, config.model.dtype)
        print(f"check --packing {verdict}", flush=True)
    return 1 if failures else 0
