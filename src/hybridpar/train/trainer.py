"""The training loop: packed batches -> shard_inputs -> forward/backward -> AdamW.

    for step:
        packs of this data-parallel rank (one micro-batch each, gradients accumulate;
                                          FSDP reduces them once, after the last)
        count valid tokens of the whole step over dp              (one all-reduce)
        per pack: shard over cp (and tp for sequence parallel) -> model(..., labels) -> loss_sum
                  (blockwise LM head + cross entropy, no logits) / global count -> backward
        clip the global gradient norm; a non-finite loss or norm stops (or skips) the step
        AdamW step, lr schedule; a checkpoint (finite weights only) every checkpoint.every
        every train.eval_every: held-out loss (a file task's beside its unigram baseline)
    after the last step: export (model.export_hf), a printed sample (train.sample)

A run resumes exactly or not at all: the checkpoint records the model shape and the data
stream, and ``resume`` refuses a different one (see ``train/run/resume.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridpar.config import ConfigError, RunConfig, to_dict
from hybridpar.data.documents import FILE_TASKS
from hybridpar.data.packing import collate_thd, padding_fraction
from hybridpar.data.sources import prediction_counts
from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hf.checkpoint import load_hf
from hybridpar.models.hf.router_aux import router_aux_coefficient, router_aux_term, switch_form_problem
from hybridpar.models.hybrid import HybridConfig, HybridLM
from hybridpar.models.lm_head_loss import check_label_values, check_token_values
from hybridpar.parallel.dims import ParallelDims
from hybridpar.parallel.data.fsdp import set_micro_batch
from hybridpar.parallel.context.inputs import ShardedInputs, shard_inputs
from hybridpar.parallel.parallelize import parallelize
from hybridpar.parallel.precision import set_tf32
from hybridpar.parallel.state import canonical_state_dict, load_canonical_state_dict
from hybridpar.train.baseline import unigram_loss
from hybridpar.train.batches import PackStream, check_eval_labels, eval_repeat_note, pad_multiple, validate_data
from hybridpar.train.run.checkpoint import load_checkpoint, save_checkpoint
from hybridpar.train.run.export import export_trained, validate_export
from hybridpar.train.packing_rule import PROBE_TOLERANCE, leak_probe, packing_line, packing_problem
from hybridpar.train.hf_model import (build_hf_model, hf_forward_inputs, hf_loss_sum, loss_path_line, meta_model,
                                      model_backend, randomness_problem, use_blockwise_attention)
from hybridpar.train.loss import global_sum, real_token_mask, valid_token_count
from hybridpar.train.run.metrics import MetricsLogger, notice, peak_memory_gib
from hybridpar.train.nonfinite import NonFiniteError, NonFiniteGuard, assert_finite_state, step_schedule
from hybridpar.train.peft import apply_peft, key_dropout, lora_line
from hybridpar.train.run.adapters import adapter_layout, base_reference, check_same_base
from hybridpar.train.optim import apply_settings, build_optimizer, build_scheduler, clip_grad_norm
from hybridpar.train.preflight import check_model_memory, check_pack_memory, model_config, parallel_dims, validate_layout
from hybridpar.train.run.resume import data_stream, model_signature, nothing_left_note, prepare_output_dir, print_notes
from hybridpar.train.run.fingerprints import data_sources
from hybridpar.train.run.tokenizer import shared_data
from hybridpar.train.sample import check_sample, print_sample, sample_settings
from hybridpar.train.tensor_peak import step_tensor_peak

__all__ = ["Trainer", "build_model", "pack_tensors", "pack_loss_sum", "parallel_dims", "DTYPES"]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def build_model(config: RunConfig) -> nn.Module:
    """The single-device model of the config (seeded, so every rank builds the same one): a
    ``HybridLM``, or a transformers model for ``model.backend`` (``train/hf_model.py``)."""
    if config.model.dtype not in DTYPES:
        raise ValueError(f"model.dtype={config.model.dtype!r} is unknown; choose one of {sorted(DTYPES)}.")
    dtype = DTYPES[config.model.dtype]
    torch.manual_seed(config.train.seed)
    if model_backend(config) == "transformers":
        return build_hf_model(config, dtype)
    if config.model.hf_path:
        return load_hf(config.model.hf_path, dtype=dtype)
    return HybridLM(HybridConfig.from_preset(config.model.preset, dtype=dtype, **config.model.overrides))


def pack_loss_sum(model: nn.Module, sharded: ShardedInputs, predictions: bool = False) -> tuple[Tensor, Tensor | None]:
    """``(summed token loss, argmax ids or None)`` of this rank's share of a pack (``shard_inputs``'s
    output), through a ``HybridLM`` or a transformers model (``hf_model.hf_loss_sum``)."""
    if isinstance(model, HybridLM):
        out = model(sharded.input_ids, packed=sharded.packed, labels=sharded.labels, return_predictions=predictions)
        return out[0], out[2] if predictions else None
    return hf_loss_sum(model, sharded.input_ids, sharded.labels, hf_forward_inputs(sharded, model), predictions)


@dataclass
class Layout:
    """The mesh and the groups one training step needs."""

    dims: ParallelDims
    mesh: object
    cp_group: object
    tp_group: object
    dp_group: object
    dp_cp_group: object
    dp_rank: int

    @classmethod
    def build(cls, config: RunConfig, device_type: str) -> "Layout":
        dims = parallel_dims(config)
        mesh = dims.build_mesh(device_type)
        dp_mesh = ParallelDims.mesh(mesh, "dp")
        return cls(
            dims, mesh, ParallelDims.group(mesh, "cp"), ParallelDims.group(mesh, "tp"),
            dp_mesh.get_group(), ParallelDims.group(mesh, "dp_cp"), dp_mesh.get_local_rank(),
        )


def pack_tensors(pack: dict, device: torch.device, vocab_size: int | None = None) -> tuple[Tensor, Tensor, PackedSeqParams]:
    """``input_ids, labels [1, T]`` and the document layout of one pack. With ``vocab_size``, ids and labels
    outside the vocabulary are refused here, on the CPU (on CUDA the embedding would assert or, vocab-parallel,
    read zeros, and a check there would sync every step)."""
    batch = collate_thd([pack])
    if vocab_size is not None:
        check_token_values(batch["input_ids"], vocab_size)
        check_label_values(batch["labels"].reshape(-1), vocab_size)
    return batch["input_ids"].to(device), batch["labels"].to(device), PackedSeqParams.from_batch(batch)


class Trainer:
    """Builds the parallel model, optimizer and data of a ``RunConfig`` and trains it."""

    def __init__(self, config: RunConfig, device: torch.device):
        self.config = config
        self.device = device
        self.rank = dist.get_rank()
        p, world = config.parallel, dist.get_world_size()
        self.say(f"building the model ({config.model.hf_path or 'preset ' + config.model.preset}, {config.model.dtype}) "
                 f"on {world} process{'es' * (world > 1)}: dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} "
                 f"cp={p.cp} tp={p.tp}")
        # Everything that can be wrong with the input is found before the first collective.
        shape, local_ranks = model_config(config), int(os.environ.get("LOCAL_WORLD_SIZE", world))
        state = check_model_memory(config, apply_peft(config, meta_model(shape)), local_ranks, moments=False)  # no weight yet
        model = apply_peft(config, build_model(config))  # peft.method=lora: frozen base + adapters
        if lora_line(model):
            self.say(lora_line(model))
        adapters = adapter_layout(model)  # names before parallelize: the same at every layout
        self.vocab_size = model.config.vocab_size
        validate_layout(config, dist.get_world_size(), model=model, shape=shape)
        check_pack_memory(config, shape, local_ranks, state, model)
        check_sample(config)
        self.sample = sample_settings(config.train.sample)
        self.data = shared_data(config, self.vocab_size)  # data.tokenizer=bpe: trained by rank 0 if absent
        self.tokenizer = validate_data(self.data, self.vocab_size, config.model.hf_path)
        validate_export(config, shape)  # before training, not after it
        self.signature = model_signature(shape)
        self.pad = pad_multiple(self.data, p.cp)
        self.data_sources = data_sources(config)  # the content this run reads, recorded in its checkpoints
        if not isinstance(model, HybridLM) and p.cp == 1:  # at cp > 1 parallelize installs it with the CP core
            self.say(use_blockwise_attention(model))
        if not isinstance(model, HybridLM):
            self.say(loss_path_line(model))
        self.unkeyed = None if isinstance(model, HybridLM) else randomness_problem(config, model, self.vocab_size, world)
        if (why := router_aux_coefficient(model.config) and switch_form_problem(model, self.vocab_size)) and p.cp == 1:
            self.say(f"router auxiliary loss: {type(model).__name__}'s own, padded positions counted ({why})")
        elif why:
            raise ConfigError(f"parallel.cp={p.cp}: {type(model).__name__}'s router auxiliary loss cannot be split over "
                              f"a pack's ranks: {why}; use parallel.cp=1, or set \"output_router_logits\": false in "
                              f"{config.model.hf_path}/config.json.")
        problem = self._packing_problem(model)
        self.one_per_row = problem is not None
        self.train_data = self._stream(self.data)
        cp_pad = self.pad if p.cp > 1 and self.data.pad_to_multiple_of is None else None  # 2*cp, chosen here
        self.say(packing_line(model, problem, padding_fraction(self.train_data.pool), self.data.pack_size, cp_pad))
        self._eval_data = self._unigram = None
        self.layout = Layout.build(config, device.type)
        set_tf32(config.parallel.tf32 and config.model.dtype == "float32")  # CUDA float32 matmuls only
        self.model = parallelize(
            model, self.layout.dims, mesh=self.layout.mesh,
            cp_attention=config.parallel.cp_attention, cp_mamba=config.parallel.cp_mamba,
            sequence_parallel=config.parallel.sequence_parallel,
            activation_checkpointing=config.parallel.activation_checkpointing,
            mixed_precision=config.parallel.mixed_precision,
            reshard_after_forward=config.parallel.reshard_after_forward, compile=config.parallel.compile,
        )
        self.optimizer = build_optimizer(self.model, config.train)
        lora_base = [base_reference(config) if self.rank == 0 else None]  # peft.method=lora: the base's path and hash
        dist.broadcast_object_list(lora_base, src=0)  # hashed once; every rank refuses a foreign base alike
        self.lora_base = lora_base[0] and {**lora_base[0], "adapters": adapters}
        self.scheduler = build_scheduler(self.optimizer, config.train)
        self.guard = NonFiniteGuard(config.train.on_nonfinite, config.train.max_nonfinite_skips)
        self.start_step = 0
        self.output_dir = config.output_dir
        self.run_id = self.last_checkpoint = self._lock = None

    def say(self, text: str) -> None:
        """A progress line from rank 0."""
        if self.rank == 0:
            print(text, flush=True)

    def _packing_problem(self, model: nn.Module) -> str | None:
        """Why documents must not share a row (``train/packing_rule.py``); at cp = 1 a transformers
        model the rule accepts is also probed (two documents packed against each alone)."""
        problem = packing_problem(model)
        if problem is None and not isinstance(model, HybridLM) and self.config.parallel.cp == 1:
            leak = leak_probe(model, self.vocab_size)
            tolerance = PROBE_TOLERANCE.get(next(model.parameters()).dtype, 3e-2)
            if not leak <= tolerance:
                problem = (f"the leak probe found two packed documents' logits {leak:.1e} (relative) away from each "
                           f"run alone, above {tolerance:.0e}")
        return problem

    def _stream(self, data, seed_offset: int = 0) -> PackStream:
        return PackStream(data, self.config.parallel.cp, self.vocab_size, seed_offset=seed_offset,
                          pad_to_multiple_of=self.pad, tokenizer=self.tokenizer, one_per_row=self.one_per_row)

    @property
    def eval_data(self) -> PackStream:
        if self._eval_data is None:
            eval_config = dataclasses.replace(self.data, packs_per_step=self.config.train.eval_packs)
            self._eval_data = self._stream(eval_config, seed_offset=10_000)
            check_eval_labels(self._eval_data, self.config.data.pack_size)  # before step 1 (_loop)
            if note := eval_repeat_note(self._eval_data):  # at the first evaluation
                notice(note)
        return self._eval_data

    # -- one step ---------------------------------------------------------------------------
    def forward_loss_sum(self, pack: dict, predictions: bool = False, at=None) -> tuple[Tensor, Tensor | None, Tensor]:
        """``(loss_sum, argmax ids or None, this rank's inputs)`` of its share of a pack; ``at``: (step, pack index) keys
        dropout."""
        input_ids, labels, packed = pack_tensors(pack, self.device, self.vocab_size)
        sharded = shard_inputs(
            input_ids=input_ids, labels=labels, packed=packed, cp_group=self.layout.cp_group,
            tp_group=self.layout.tp_group, sequence_parallel=self.config.parallel.sequence_parallel,
        )
        if at is not None:
            key_dropout(self.model, *at, sharded)
        loss_sum, predicted = pack_loss_sum(self.model, sharded, predictions)
        return loss_sum, predicted, sharded

    def step_gradients(self, step: int) -> Tensor | None:
        """Forward/backward of every pack of ``step`` on this rank; returns the global loss (None: no labelled token)."""
        packs = self.train_data.rank_packs(step, self.layout.dp_rank, self.layout.dims.size("dp"))
        count = global_sum(sum(valid_token_count(p["labels"]) for p in packs), self.layout.dp_group)
        if int(count) == 0:  # on every rank alike: the step is skipped (NonFiniteGuard.empty), no collective waits
            return None
        loss_total, aux_total = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for index, pack in enumerate(packs):
            set_micro_batch(self.model, index, len(packs))  # FSDP reduces gradients once, after the last pack
            loss_sum, _, sharded = self.forward_loss_sum(pack, at=(step, self.layout.dp_rank * len(packs) + index))
            aux = router_aux_term(self.model, self.config.data.packs_per_step, self._cp_sum if self.layout.dims.cp > 1
                                  else None, real_token_mask(pack)[sharded.global_positions().cpu()])  # MoE balancing
            (loss_sum / count + (0 if aux is None else aux)).backward()
            loss_total += loss_sum.detach().double()
            aux_total += 0 if aux is None else aux.detach().double()
        loss = global_sum(loss_total, self.layout.dp_cp_group) / count
        return loss + global_sum(aux_total, self.layout.dp_cp_group) if router_aux_coefficient(self.model.config) else loss

    def _cp_sum(self, value: Tensor) -> Tensor:
        """``value`` summed over the ranks that share a pack (``router_aux_term``'s ``reduce``)."""
        return global_sum(value, self.layout.cp_group)

    def train_step(self, step: int) -> dict:
        """One optimizer step; a non-finite loss or gradient norm is stopped (or skipped) by the guard."""
        if (loss := self.step_gradients(step)) is None:  # nothing to learn: no loss, no update
            return self.guard.empty(step + 1, self.scheduler, self.config.data.pack_size, notice if self.rank == 0 else None)
        grad_norm = clip_grad_norm(self.model.parameters(), self.config.train.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        metrics = {"loss": float(loss), "grad_norm": float(grad_norm), "lr": lr}
        try:
            apply = self.guard.check(step + 1, metrics["loss"], metrics["grad_norm"], lr)
        except NonFiniteError as error:
            error.metrics = metrics
            raise
        if apply:
            self.optimizer.step()
        step_schedule(self.scheduler)
        self.optimizer.zero_grad(set_to_none=True)
        if self.guard.skipped:
            metrics["skipped_steps"] = self.guard.skipped
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss and answer accuracy on held-out packs (the synthetic task's metric)."""
        packs = self.eval_data.rank_packs(0, self.layout.dp_rank, self.layout.dims.size("dp"))
        sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, answers
        for pack in packs:
            loss_sum, predicted, sharded = self.forward_loss_sum(pack, predictions=True)
            correct, total = prediction_counts(predicted, sharded.labels)
            sums += torch.stack([loss_sum.double(), correct.double(), total.double()])
        sums = global_sum(sums, self.layout.dp_cp_group)
        metrics = {"eval_loss": float(sums[0] / sums[2].clamp(min=1)), "eval_accuracy": float(sums[1] / sums[2].clamp(min=1))}
        if self.config.data.task in FILE_TASKS:  # the unigram baseline of the same held-out tokens
            if self._unigram is None:
                self._unigram = unigram_loss(self.train_data.pool, self.eval_data.step_packs(0), self.vocab_size)
            metrics["unigram_loss"] = self._unigram
        return metrics

    def print_sample(self) -> None:
        """``train.sample``: gather the full weights, continue the prompt on rank 0 (``train/sample.py``)."""
        state = canonical_state_dict(self.model)
        if self.rank == 0:  # peft.method=lora: the adapters too (the base alone refused the state, after training)
            model = apply_peft(self.config, build_model(self.config)).to(self.device)
            load_canonical_state_dict(model, state)
            print_sample(model, self.tokenizer, self.sample)

    def export_hf(self, path: str) -> None:
        """``model.export_hf``: gather the full weights and write them on rank 0 (``run/export.py``)."""
        export_trained(self.model, self.config, path, self.tokenizer, self.last_checkpoint, self.rank)

    # -- the loop -----------------------------------------------------------------------------
    def resume(self) -> None:
        """Lock the output directory, pick the checkpoint (or refuse), and load it."""
        plan, self._lock = prepare_output_dir(self.config, self.signature)
        if self.rank == 0:
            print_notes(plan.notes)
        self.output_dir, self.run_id = plan.output_dir, plan.run_id
        if plan.checkpoint is None:
            return
        if plan.pad_to_multiple_of != self.pad:  # continue with the checkpoint's padding: the same batches
            self.pad, self._eval_data = plan.pad_to_multiple_of, None
            self.train_data = self._stream(self.data)
        check_same_base(plan.checkpoint, self.lora_base)  # adapters resume only on their own base
        state = load_checkpoint(plan.checkpoint, self.model, self.optimizer, self.scheduler)
        apply_settings(self.optimizer, self.scheduler, self.config.train)  # changed ones were said (numerics.py)
        self.start_step = state["step"]
        self.guard.skipped, self.guard.empty_steps = state.get("nonfinite_skips", 0), state.get("empty_steps", 0)
        self.last_checkpoint = plan.checkpoint
        self.say(f"resumed from {plan.checkpoint} at step {self.start_step}")

    def save(self, step: int) -> None:
        """A checkpoint of ``step``, only if every weight and optimizer state is finite."""
        started = time.perf_counter()
        kept = f"the last one, {self.last_checkpoint}, is kept" if self.last_checkpoint else "there is none before it"
        assert_finite_state({"model": dict(self.model.named_parameters()),
                             "optim": {str(i): s for i, s in enumerate(self.optimizer.state.values())}}, step, kept)
        run_info = {"run_id": self.run_id, "model": self.signature, "data": data_stream(self.config, self.pad, self.data_sources),
                    "config": to_dict(self.config), "lora_base": self.lora_base}
        path = save_checkpoint(f"{self.output_dir}/checkpoints", step, self.model, self.optimizer, self.scheduler,
                               extra={"config": to_dict(self.config), "nonfinite_skips": self.guard.skipped,
                                      "empty_steps": self.guard.empty_steps},
                               keep=self.config.checkpoint.keep, run_info=run_info)
        self.last_checkpoint = str(path)
        self.say(f"saved checkpoint {path} ({time.perf_counter() - started:.1f} s)")

    def fit(self, stop_after: int | None = None) -> list[dict]:
        """Train to ``train.steps`` (or stop after step ``stop_after``, as an interruption
        would); returns the metrics history (rank 0)."""
        cfg = self.config
        if self.unkeyed and self.rank == 0:  # check refuses it (proof/layout.py)
            notice(self.unkeyed)
        try:  # the lock is released on every way out, a refusal while resuming included
            self.resume()  # the metrics are closed on every way out too (a failure of theirs hides no error)
            with MetricsLogger(self.output_dir, self.rank, cfg.tensorboard, cfg.plot, resume_step=self.start_step) as logger:
                self._loop(logger, cfg.train.steps if stop_after is None else min(stop_after, cfg.train.steps))
                if cfg.model.export_hf:
                    self.export_hf(cfg.model.export_hf)
                if self.sample is not None and stop_after is None:
                    self.print_sample()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None
        if logger.curve is not None:
            print(f"loss curve: {logger.curve}", flush=True)
        return logger.history

    def _loop(self, logger: MetricsLogger, end: int) -> None:
        cfg = self.config
        every = cfg.checkpoint.every
        self.model.train()
        if cfg.train.eval_every and self.start_step < end:
            self.eval_data  # held-out packs built (and too few documents refused) before step 1, not at the first eval
        if self.start_step < end:
            self.say(f"first step: training steps {self.start_step + 1}-{end} of {cfg.train.steps} "
                     "(the first one also warms up)")
        elif self.start_step >= cfg.train.steps and self.rank == 0:
            notice(nothing_left_note(self.start_step, cfg.train.steps))
        measured = False  # CPU: live-tensor peak of one steady-state step (the second, or the only one), or the
        for step in range(self.start_step, end):  # next that trains: an empty one ran nothing (it showed "tensors 0.000")
            started = time.perf_counter()
            peak = step_tensor_peak(self.model, self.optimizer, self.device) if step >= min(self.start_step + 1, end - 1) \
                and not measured else None
            try:
                with peak or contextlib.nullcontext():
                    metrics = self.train_step(step)
            except NonFiniteError as error:
                logger.log(step + 1, getattr(error, "metrics", {}), echo=True)
                raise
            metrics["tokens_per_s"] = cfg.data.packs_per_step * cfg.data.pack_size / (time.perf_counter() - started)
            metrics["peak_memory_gib"] = peak_memory_gib()
            if peak is not None and "loss" in metrics:
                metrics["tensor_peak_gib"], measured = peak.gib, True
            last = step + 1 == cfg.train.steps
            if cfg.train.eval_every and ((step + 1) % cfg.train.eval_every == 0 or last):
                self.model.eval()
                metrics.update(self.evaluate())
                self.model.train()
            echo = step == self.start_step or (step + 1) % cfg.train.log_every == 0 or last or "eval_loss" in metrics
            logger.log(step + 1, metrics, echo=echo)  # every step goes to metrics.jsonl and the curve
            if (every > 0 and (step + 1) % every == 0) or (last and every >= 0):  # -1: never
                self.save(step + 1)
