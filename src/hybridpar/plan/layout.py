"""What a plan is computed for: the model shape, the layout and the per-rank token counts.

Symbols used by every ``plan`` module (per rank, per packed row of ``T`` tokens)::

    Tc = T / cp            tokens a CP rank holds (inside a block, widths are / tp)
    Ts = Tc / tp (SP) or Tc  tokens of the residual stream between blocks
    e   activation bytes (model dtype; 2 under mixed_precision=bf16)
    e_s residual-stream bytes: e, but the model dtype under autocast (bf16 without FSDP keeps
        the stream and norms in float32; only matmuls run in bf16)
    e_p parameter / gradient / optimizer-state bytes (model dtype)
    e_a LoRA adapter parameter / gradient / optimizer-state bytes (4 on a bfloat16 base, else e_p)
    e_c = max(e, 4)        bytes of the kernels' compute dtype (float32 or wider)
    m = packs_per_step / dp  packed rows each rank runs per step (gradient accumulation)
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridpar.config import RunConfig
from hybridpar.models.hybrid import HybridConfig
from hybridpar.parallel.dims import ParallelDims

__all__ = ["Layout", "DTYPE_BYTES", "adapter_bytes"]

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}


def adapter_bytes(dtype: str) -> int:
    """Bytes per LoRA adapter element on a base of ``dtype``: float32 on bfloat16 (``models.lora.adapter_dtype``)."""
    return max(4, DTYPE_BYTES[dtype])


@dataclass(frozen=True)
class Layout:
    """A validated run, reduced to what memory and traffic depend on."""

    model: HybridConfig
    dims: ParallelDims
    pack_size: int
    packs_per_step: int
    dtype: str = "float32"
    sequence_parallel: bool = False
    cp_attention: str = "allgather"
    cp_mamba: str = "a2a"
    checkpointing: str = "none"
    mixed_precision: str | None = None
    reshard_after_forward: bool | int = True
    lora_rank: int = 0  # peft.method=lora: the adapters' rank (0: full fine-tuning)
    lora_targets: tuple[str, ...] = ()  # the adapted linear layers by name (peft.target_modules or the defaults)
    lora_parameters: tuple[str, ...] = ()  # adapted stacked expert weights (peft.target_parameters; MoE twins)
    hf_decoder: bool = False  # a transformers decoder planned through its HybridLM twin (plan/hf/twin.py)
    tf32: bool = True  # parallel.tf32: float32 matmuls on TF32 tensor cores (the time estimate's rate)

    @classmethod
    def from_run(cls, run: RunConfig, model: HybridConfig, hf_decoder: bool = False) -> "Layout":
        from hybridpar.models.lora import DEFAULT_TARGETS

        p, lora = run.parallel, run.peft.method == "lora"
        return cls(model, ParallelDims(p.dp_replicate, p.dp_shard, p.cp, p.tp), run.data.pack_size,
                   run.data.packs_per_step, run.model.dtype, p.sequence_parallel, p.cp_attention, p.cp_mamba,
                   p.activation_checkpointing, p.mixed_precision, p.reshard_after_forward,
                   run.peft.r if lora else 0, tuple(run.peft.target_modules or DEFAULT_TARGETS) if lora else (),
                   tuple(run.peft.target_parameters or ()) if lora else (), hf_decoder, p.tf32)

    @property
    def paired(self) -> bool:
        """A transformers decoder layer is two twin blocks (mixer, MLP): one checkpoint and one FSDP unit."""
        return self.hf_decoder and getattr(self.model, "paired_layers", True)

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.dims.tp > 1

    @property
    def fsdp(self) -> bool:
        return self.dims.size("dp_shard_cp") > 1 or self.dims.dp_replicate > 1

    @property
    def shard(self) -> int:
        """FSDP shard group size ``dp_shard * cp`` (1: parameters not sharded)."""
        return self.dims.size("dp_shard_cp") if self.fsdp else 1

    @property
    def tokens(self) -> int:  # Tc
        return self.pack_size // self.cp

    @property
    def stream_tokens(self) -> int:  # Ts
        return self.tokens // self.tp if self.sp else self.tokens

    @property
    def packs_per_rank(self) -> int:  # m
        return max(1, self.packs_per_step // self.dims.size("dp"))

    @property
    def param_bytes(self) -> int:  # e_p
        return DTYPE_BYTES[self.dtype]

    @property
    def adapter_bytes(self) -> int:  # e_a
        return adapter_bytes(self.dtype)

    @property
    def autocast(self) -> bool:
        """``mixed_precision=bf16`` without FSDP: the forward runs under ``torch.autocast``."""
        return self.mixed_precision == "bf16" and not self.fsdp

    @property
    def act_bytes(self) -> int:  # e
        return 2 if self.mixed_precision == "bf16" else DTYPE_BYTES[self.dtype]

    @property
    def stream_bytes(self) -> int:  # e_s
        return DTYPE_BYTES[self.dtype] if self.autocast else self.act_bytes

    @property
    def compute_bytes(self) -> int:  # e_c
        return max(self.act_bytes, 4)

    @property
    def matmul_precision(self) -> str:
        """What the matmuls run in: ``bf16`` (mixed precision or bfloat16 weights), ``tf32`` (float32 with
        ``parallel.tf32``), ``float32`` or ``float64``."""
        if self.mixed_precision == "bf16" or self.dtype == "bfloat16":
            return "bf16"
        return "tf32" if self.dtype == "float32" and self.tf32 else self.dtype

    def describe(self) -> str:
        p = self.dims
        return (f"dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} cp={p.cp} tp={p.tp} "
                f"sp={'on' if self.sp else 'off'} cp_attention={self.cp_attention} cp_mamba={self.cp_mamba} "
                f"checkpointing={self.checkpointing}" + (f" lora_r={self.lora_rank}" if self.lora_rank else ""))
