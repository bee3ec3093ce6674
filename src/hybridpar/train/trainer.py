"""The training loop: packed batches -> shard_inputs -> forward/backward -> AdamW.

    for step:
        packs of this data-parallel rank (one micro-batch each, gradients accumulate;
                                          FSDP reduces them once, after the last)
        count valid tokens of the whole step over dp              (one all-reduce)
        per pack: shard over cp (and tp for sequence parallel) -> model(..., labels) -> loss_sum
                  (blockwise LM head + cross entropy, no logits) / global count -> backward
        clip the global gradient norm, AdamW step, lr schedule
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from hybridpar.config import RunConfig, to_dict
from hybridpar.data.packing import collate_thd
from hybridpar.data.sources import prediction_counts
from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hybrid import HybridConfig, HybridLM
from hybridpar.parallel.dims import ParallelDims
from hybridpar.parallel.fsdp import set_micro_batch
from hybridpar.parallel.inputs import shard_inputs
from hybridpar.parallel.parallelize import parallelize, validate_parallelize
from hybridpar.parallel.state import canonical_state_dict
from hybridpar.train.batches import PackStream
from hybridpar.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from hybridpar.train.loss import global_sum, valid_token_count
from hybridpar.train.metrics import MetricsLogger, peak_memory_gib
from hybridpar.train.optim import build_optimizer, build_scheduler, clip_grad_norm

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def build_model(config: RunConfig) -> HybridLM:
    """The single-device model of the config (seeded, so every rank builds the same one)."""
    if config.model.dtype not in DTYPES:
        raise ValueError(f"model.dtype={config.model.dtype!r} is unknown; choose one of {sorted(DTYPES)}.")
    dtype = DTYPES[config.model.dtype]
    torch.manual_seed(config.train.seed)
    if config.model.hf_path:
        return HybridLM.from_hf(config.model.hf_path, dtype=dtype)
    return HybridLM(HybridConfig.from_preset(config.model.preset, dtype=dtype, **config.model.overrides))


def parallel_dims(config: RunConfig) -> ParallelDims:
    p = config.parallel
    return ParallelDims(p.dp_replicate, p.dp_shard, p.cp, p.tp)


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


def pack_tensors(pack: dict, device: torch.device) -> tuple[Tensor, Tensor, PackedSeqParams]:
    """``input_ids, labels [1, T]`` and the document layout of one pack."""
    batch = collate_thd([pack])
    return batch["input_ids"].to(device), batch["labels"].to(device), PackedSeqParams.from_batch(batch)


class Trainer:
    """Builds the parallel model, optimizer and data of a ``RunConfig`` and trains it."""

    def __init__(self, config: RunConfig, device: torch.device):
        self.config = config
        self.device = device
        self.rank = dist.get_rank()
        # Everything that can be wrong with the input is found before the first collective.
        model = build_model(config)
        self.vocab_size = model.config.vocab_size
        p = config.parallel
        validate_parallelize(
            model, parallel_dims(config), cp_attention_strategy=p.cp_attention,
            cp_mamba_strategy=p.cp_mamba, sequence_parallel=p.sequence_parallel, mixed_precision=p.mixed_precision,
            reshard_after_forward=p.reshard_after_forward, compile=p.compile,
        )
        cp = p.cp
        self.train_data = PackStream(config.data, cp, self.vocab_size, config.train.steps)
        eval_config = dataclasses.replace(config.data, packs_per_step=max(config.train.eval_packs, 1))
        self.eval_data = PackStream(eval_config, cp, self.vocab_size, 1, seed_offset=10_000)
        self.layout = Layout.build(config, device.type)
        self.model = parallelize(
            model, self.layout.dims, mesh=self.layout.mesh,
            cp_attention=config.parallel.cp_attention, cp_mamba=config.parallel.cp_mamba,
            sequence_parallel=config.parallel.sequence_parallel,
            activation_checkpointing=config.parallel.activation_checkpointing,
            mixed_precision=config.parallel.mixed_precision,
            reshard_after_forward=config.parallel.reshard_after_forward, compile=config.parallel.compile,
        )
        self.optimizer = build_optimizer(self.model, config.train)
        self.scheduler = build_scheduler(self.optimizer, config.train)
        self.start_step = 0

    # -- one step ---------------------------------------------------------------------------
    def forward_loss_sum(self, pack: dict, predictions: bool = False) -> tuple[Tensor, Tensor | None, Tensor]:
        """``(loss_sum, argmax ids or None, labels)`` of this rank's share of one pack."""
        input_ids, labels, packed = pack_tensors(pack, self.device)
        sharded = shard_inputs(
            input_ids=input_ids, labels=labels, packed=packed, cp_group=self.layout.cp_group,
            tp_group=self.layout.tp_group, sequence_parallel=self.config.parallel.sequence_parallel,
        )
        out = self.model(sharded.input_ids, packed=sharded.packed, labels=sharded.labels, return_predictions=predictions)
        return out[0], out[2] if predictions else None, sharded.labels

    def step_gradients(self, step: int) -> Tensor:
        """Forward/backward of every pack of ``step`` on this rank; returns the global loss."""
        packs = self.train_data.rank_packs(step, self.layout.dp_rank, self.layout.dims.size("dp"))
        count = global_sum(sum(valid_token_count(p["labels"]) for p in packs), self.layout.dp_group)
        if int(count) == 0:
            raise ValueError(f"step {step} has no labelled token; check data.task and data.pack_size.")
        loss_total = torch.zeros((), dtype=torch.float64)
        for index, pack in enumerate(packs):
            set_micro_batch(self.model, index, len(packs))  # FSDP reduces gradients once, after the last pack
            loss_sum, _, _ = self.forward_loss_sum(pack)
            (loss_sum / count).backward()
            loss_total += loss_sum.detach().double()
        return global_sum(loss_total, self.layout.dp_cp_group) / count

    def train_step(self, step: int) -> dict:
        loss = self.step_gradients(step)
        grad_norm = clip_grad_norm(self.model.parameters(), self.config.train.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": float(loss), "grad_norm": float(grad_norm), "lr": lr}

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss and answer accuracy on held-out packs (the synthetic task's metric)."""
        packs = self.eval_data.rank_packs(0, self.layout.dp_rank, self.layout.dims.size("dp"))
        sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, answers
        for pack in packs:
            loss_sum, predicted, labels = self.forward_loss_sum(pack, predictions=True)
            correct, total = prediction_counts(predicted, labels)
            sums += torch.stack([loss_sum.double(), correct.double(), total.double()])
        sums = global_sum(sums, self.layout.dp_cp_group)
        return {"eval_loss": float(sums[0] / sums[2].clamp(min=1)), "eval_accuracy": float(sums[1] / sums[2].clamp(min=1))}

    def export_hf(self, path: str) -> None:
        """Gather the full weights and write them (rank 0) in the Hugging Face format."""
        state = canonical_state_dict(self.model)
        if self.rank == 0:
            single = HybridLM(self.model.config)
            single.load_state_dict(state, strict=not self.model.config.tie_word_embeddings)
            for attribute in ("hf_config", "hf_prefix"):
                if hasattr(self.model, attribute):
                    setattr(single, attribute, getattr(self.model, attribute))
            single.save_hf(path, architecture=self.config.model.export_architecture)
            print(f"exported Hugging Face checkpoint: {path}", flush=True)
        dist.barrier()

    # -- the loop -----------------------------------------------------------------------------
    def resume(self) -> None:
        ckpt = self.config.checkpoint
        directory = f"{self.config.output_dir}/checkpoints"
        path = latest_checkpoint(directory) if ckpt.resume == "auto" else ckpt.resume
        if path is not None:
            state = load_checkpoint(path, self.model, self.optimizer, self.scheduler)
            self.start_step = state["step"]
            if self.rank == 0:
                print(f"resumed from {path} at step {self.start_step}", flush=True)

    def fit(self, stop_after: int | None = None) -> list[dict]:
        """Train to ``train.steps`` (or stop after step ``stop_after``, as an interruption
        would); returns the metrics history (rank 0)."""
        cfg = self.config
        self.resume()
        logger = MetricsLogger(cfg.output_dir, self.rank, cfg.tensorboard, cfg.plot, append=self.start_step > 0)
        directory = f"{cfg.output_dir}/checkpoints"
        self.model.train()
        for step in range(self.start_step, cfg.train.steps if stop_after is None else min(stop_after, cfg.train.steps)):
            started = time.perf_counter()
            metrics = self.train_step(step)
            tokens = cfg.data.packs_per_step * cfg.data.pack_size
            metrics["tokens_per_s"] = tokens / (time.perf_counter() - started)
            metrics["peak_memory_gib"] = peak_memory_gib()
            last = step + 1 == cfg.train.steps
            if cfg.train.eval_every and ((step + 1) % cfg.train.eval_every == 0 or last):
                self.model.eval()
                metrics.update(self.evaluate())
                self.model.train()
            echo = step == self.start_step or (step + 1) % cfg.train.log_every == 0 or last or "eval_loss" in metrics
            logger.log(step + 1, metrics, echo=echo)  # every step goes to metrics.jsonl and the curve
            if (cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0) or (last and cfg.checkpoint.every >= 0):
                save_checkpoint(directory, step + 1, self.model, self.optimizer, self.scheduler,
                                extra={"config": to_dict(cfg)}, keep=cfg.checkpoint.keep)
        if cfg.model.export_hf:
            self.export_hf(cfg.model.export_hf)
        plot = logger.close()
        if plot is not None:
            print(f"loss curve: {plot}", flush=True)
        return logger.history
